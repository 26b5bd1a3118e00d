"""``Fabric(strategy=RoundPipeFabricStrategy(shard_host_state=...), num_nodes=2)`` as two
processes on 127.0.0.1 (gloo, 2 CPU workers each), launched through the environment
(``_fabric_shard_worker.py``).

* Same numbers: AdamW, ``async_step=False`` (and, for a bf16 module, ``True``: one step
  stale), two backward calls per step, ``fabric.clip_gradients`` (the norm over both
  shards): sharded == unsharded within 1e-6 after several steps, and both nodes hold
  the same weights.
* Memory: each sharded node holds about half of the optimizer state, and half of the
  fp32 masters of a bf16 module, stepping synchronously or asynchronously.
* Checkpoints: ``fabric.save`` writes the file plus one shard per node; ``fabric.load``
  of it continues exactly as the run that was never interrupted, on the same node
  count (bit for bit) and in one process (another node count).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import rel_err  # noqa: E402
from test_lightning_ddp import DEADLINE_S, _launch, _logs, _wait  # noqa: E402

FABRIC_WORKER = Path(__file__).with_name("_fabric_shard_worker.py")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fabric_sharded")
    procs = _launch(out, FABRIC_WORKER)
    try:
        codes = _wait(procs, DEADLINE_S + 90)  # (three variants, each trained and resumed)
    finally:
        _wait(procs, 0.1)
    assert codes == [0, 0], f"nodes exited with {codes} (None = hung and killed)\n{_logs(out)}"
    return out


def _results(nodes: Path, name: str) -> list[dict]:
    return [torch.load(nodes / f"{name}_rank{r}.pt") for r in range(2)]


@pytest.mark.host_only  # all in child processes
@pytest.mark.timeout(DEADLINE_S + 150)
@pytest.mark.parametrize("suffix", ["", "_bf16", "_bf16_async"], ids=["fp32", "bf16", "async"])
def test_sharded_fabric_equals_unsharded_fabric(nodes: Path, suffix: str) -> None:
    """bf16: a bf16-true module whose fp32 masters are sharded too (each node keeps half)."""
    plain, sharded = _results(nodes, "plain" + suffix), _results(nodes, "sharded" + suffix)
    for phase in ("first", "continued"):
        for k, want in plain[0][phase].items():
            assert torch.equal(plain[1][phase][k], want), f"unsharded nodes differ: {phase} {k}"
            for rank in range(2):
                err = rel_err(sharded[rank][phase][k], want)
                assert err <= 1e-6, f"{phase} rank {rank}: {k} rel err {err:.2e}"
    # not vacuous: training moved the weights
    start = plain[0]["first"]
    assert any(not torch.equal(start[k], plain[0]["continued"][k]) for k in start)
    # each node keeps about half of the optimizer state (AdamW: exp_avg, exp_avg_sq, step)
    whole = plain[0]["opt_bytes"]
    assert plain[1]["opt_bytes"] == whole
    shares = [sharded[r]["opt_bytes"] for r in range(2)]
    assert all(0 < s <= whole * (1 / 2 + 0.05) for s in shares), (shares, whole)
    assert sum(shares) == whole, (shares, whole)
    masters = [sharded[r]["master_bytes"] for r in range(2)]
    if suffix:  # the fp32 masters: half each, async too (an fp32 module's are its weights)
        assert all(0 < m <= plain[0]["master_bytes"] * (1 / 2 + 0.05) for m in masters)
    else:
        assert masters == [0, 0] and plain[0]["master_bytes"] == 0


@pytest.mark.host_only  # all in child processes
@pytest.mark.timeout(DEADLINE_S + 150)
@pytest.mark.parametrize(
    "name",
    ["plain", "sharded", "plain_bf16", "sharded_bf16", "plain_bf16_async", "sharded_bf16_async"],
)
def test_fabric_checkpoint_resumes_exactly_on_two_nodes(nodes: Path, name: str) -> None:
    for rank, res in enumerate(_results(nodes, name)):
        for k, want in res["continued"].items():
            assert torch.equal(res["resumed"][k], want), f"{name} rank {rank}: {k} after resume"


@pytest.mark.timeout(DEADLINE_S + 150)
def test_sharded_fabric_checkpoint_files_and_resume_in_one_process(nodes: Path) -> None:
    from _fabric_shard_worker import NODE_BATCH, resume

    from roundpipe_lightning.sharded_checkpoint import SHARDS_KEY, fabric_shards_dir

    ckpt = nodes / "sharded.ckpt"
    assert sorted(f.name for f in fabric_shards_dir(ckpt, "optimizer").iterdir()) == [
        "shard-00000-of-00002.pt",
        "shard-00001-of-00002.pt",
    ]
    main = torch.load(ckpt, weights_only=False)
    assert SHARDS_KEY in main["optimizer"] and "state" not in main["optimizer"]
    # one process on the whole batches (the two nodes' halves): the 2-node continuation
    got = resume(1, False, ckpt, 2 * NODE_BATCH)
    want = _results(nodes, "sharded")[0]["continued"]
    for k, v in want.items():
        assert rel_err(got[k], v) <= 1e-5, k


def test_a_shard_key_that_cannot_name_a_directory_is_refused() -> None:
    from roundpipe_lightning.sharded_checkpoint import fabric_shards_dir

    assert fabric_shards_dir("a.ckpt", "opt").as_posix() == "a.ckpt.shards/opt"
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="cannot, use a plain name"):
            fabric_shards_dir("a.ckpt", bad)
