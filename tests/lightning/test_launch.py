"""A RoundPipe process drives all of its node's devices, so a launcher that starts several
processes on one node (``torchrun --nproc-per-node 2`` with ``num_nodes=1``) would have each
claim the same devices and silently train 2-process data parallel: it is refused at fit,
before anything connects, with how to launch instead. The environments are faked."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from rpl_helpers import SeqModule, loader, trainer_kwargs

from roundpipe_lightning import RoundPipeStrategy

pytestmark = pytest.mark.host_only


def _torchrun(rank: int, nproc: int, nnodes: int = 1) -> dict[str, str]:
    """What ``torchrun --nnodes nnodes --nproc-per-node nproc`` puts in process ``rank``'s env."""
    return {
        "TORCHELASTIC_RUN_ID": "rp-test",
        "WORLD_SIZE": str(nproc * nnodes),
        "LOCAL_WORLD_SIZE": str(nproc),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % nproc),
        "GROUP_RANK": str(rank // nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29531",
    }


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # set_world_ranks sets it

    def apply(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return apply


def _trainer(num_nodes: int = 1) -> L.Trainer:
    return L.Trainer(
        **trainer_kwargs(strategy=RoundPipeStrategy(), devices=2, num_nodes=num_nodes, max_steps=1)
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_torchrun_two_processes_on_one_node_is_refused(launched, rank: int) -> None:
    launched(_torchrun(rank, nproc=2))
    with pytest.raises(ValueError, match=r"one process per node.*--nproc-per-node 1") as info:
        _trainer().fit(SeqModule(), loader())
    assert "LOCAL_WORLD_SIZE=2" in str(info.value)
    assert "python train.py" in str(info.value)


def test_a_second_local_process_without_torchrun_is_refused(launched) -> None:
    """The plain environment (LightningEnvironment): the second process has LOCAL_RANK=1."""
    launched({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="LOCAL_RANK=1"):
        _trainer().fit(SeqModule(), loader())


def test_more_processes_than_nodes_is_refused(launched) -> None:
    env = _torchrun(0, nproc=1, nnodes=2)  # two processes, but the Trainer says one node
    launched(env)
    with pytest.raises(ValueError, match=r"2 processes \(WORLD_SIZE\) for num_nodes=1"):
        _trainer(num_nodes=1).fit(SeqModule(), loader())


def test_one_process_per_node_passes_the_check(launched) -> None:
    launched(_torchrun(0, nproc=1, nnodes=2))
    strategy = _trainer(num_nodes=2).strategy
    assert isinstance(strategy, RoundPipeStrategy)
    assert strategy.check_launch() is strategy.cluster_environment  # no error: a valid layout


def test_trainer_and_fabric_word_the_refusal_the_same(launched) -> None:
    """One message builder for both strategies: the same launch gets the same words,
    only the strategy and what the user builds (Trainer / Fabric) differ."""
    import torch
    from lightning.fabric import Fabric
    from torch import nn

    launched(_torchrun(0, nproc=2))
    with pytest.raises(ValueError) as trainer_info:
        _trainer().fit(SeqModule(), loader())
    fabric = Fabric(strategy="roundpipe", accelerator="cpu", devices=2)
    net = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError) as fabric_info:
        fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    as_trainer = str(fabric_info.value).replace("RoundPipeFabricStrategy", "RoundPipeStrategy")
    assert as_trainer.replace("Fabric(", "Trainer(") == str(trainer_info.value)
    assert "LOCAL_WORLD_SIZE=2" in str(fabric_info.value)
