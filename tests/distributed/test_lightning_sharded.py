"""``Trainer(strategy=RoundPipeStrategy(shard_host_state=True), num_nodes=2)`` as two
processes on 127.0.0.1 (gloo, 2 CPU workers each), against the same run unsharded.

* Same numbers: AdamW, accumulation 2, ``gradient_clip_val`` (the norm over both
  shards), an fp32 module and a bf16 one whose fp32 masters are sharded too, and the
  bf16 one with ``async_step=True`` (masters sharded too, one step stale):
  sharded == unsharded within 1e-6 (weights, and the masters the nodes hold together),
  after the first fit and after resuming from the checkpoint each wrote.
* ``async_step=True`` with sharding is accepted; ``None`` follows the hardware, as unsharded.
* The sharded checkpoint is one file plus one shard per node; it resumes in one
  process (another rank count), and ``convert_sharded_checkpoint`` makes an ordinary
  checkpoint whose optimizer state is the unsharded run's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import rel_err  # noqa: E402
from test_lightning_ddp import DEADLINE_S, _launch, _logs, _wait  # noqa: E402

LIT_SHARD_WORKER = Path(__file__).with_name("_lit_shard_worker.py")
MODES = ("sync", "separate", "async", "overlapped")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lit_sharded")
    procs = _launch(out, LIT_SHARD_WORKER)
    try:
        codes = _wait(procs, DEADLINE_S + 60)
    finally:
        _wait(procs, 0.1)
    assert codes == [0, 0], f"nodes exited with {codes} (None = hung and killed)\n{_logs(out)}"
    return out


@pytest.mark.host_only  # all in child processes
@pytest.mark.timeout(DEADLINE_S + 120)
@pytest.mark.parametrize("mode", MODES)
def test_sharded_strategy_equals_unsharded(nodes: Path, mode: str) -> None:
    plain = torch.load(nodes / f"{mode}_plain_rank0.pt")
    # unsharded, on_before_optimizer_step reads the module's gradients reduced over the
    # nodes (as DDP's): the same on both (bf16 modules once saw each node's own copy)
    grads = [torch.load(nodes / f"{mode}_plain_rank{r}.pt")["first_grads"] for r in (0, 1)]
    if mode == "overlapped":  # no hook: each fit's calls after its first are non-blocking
        assert all(kinds[1:] == ["LazyLoss"] * (len(kinds) - 1) for kinds in plain["loss_kinds"])
        assert all(len(kinds) > 1 for kinds in plain["loss_kinds"]), plain["loss_kinds"]
    else:
        assert grads[0] and set(grads[0]) == set(grads[1]) == set(plain["first"])
        for k, g in grads[0].items():
            assert torch.equal(g, grads[1][k]) and g.abs().max() > 0, (mode, k)
    for rank in range(2):
        sharded = torch.load(nodes / f"{mode}_sharded_rank{rank}.pt")
        if mode == "overlapped":
            assert sharded["loss_kinds"] == plain["loss_kinds"], (rank, sharded["loss_kinds"])
        for phase in ("first", "resumed"):
            for k, want in plain[phase].items():
                err = rel_err(sharded[phase][k], want)
                assert err <= 1e-6, f"{mode} {phase} rank {rank}: {k} rel err {err:.2e}"
        # as loaded, before a step: every node's masters the saved ones, exactly
        for k, saved in sharded["first_masters"].items():
            assert torch.equal(sharded["loaded_masters"][k], saved), (mode, rank, k)
        # the masters (fp32; bf16-true: separate, each on one node when sharded)
        for phase in ("first_masters", "resumed_masters"):
            shares = [torch.load(nodes / f"{mode}_sharded_rank{r}.pt")[phase] for r in (0, 1)]
            if mode != "sync":  # each master on one node only
                assert not set(shares[0]) & set(shares[1]), phase
                assert shares[0] and shares[1], phase
            held = {**shares[0], **shares[1]}
            assert set(held) == set(plain[phase])
            for k, want in plain[phase].items():
                err = rel_err(held[k], want)
                assert err <= 1e-6, f"{mode} {phase}: {k} rel err {err:.2e}"
    # not vacuous: the resumed run trained further
    assert any(not torch.equal(plain["first"][k], plain["resumed"][k]) for k in plain["first"])


@pytest.mark.timeout(DEADLINE_S + 120)
def test_sharded_checkpoint_files_convert_and_resume_on_one_process(
    nodes: Path, tmp_path: Path
) -> None:
    import lightning as L  # noqa: F401  (imported here: the module's other tests need no Lightning)
    from _lit_shard_worker import GLOBAL_BATCH, RESUMED_STEPS, Lit, dataset, trainer
    from torch.utils.data import DataLoader

    from roundpipe_lightning.sharded_checkpoint import convert_sharded_checkpoint, shards_dir

    ckpt = nodes / "sync_sharded.ckpt"
    assert sorted(f.name for f in shards_dir(ckpt, 0).iterdir()) == [
        "shard-00000-of-00002.pt",
        "shard-00001-of-00002.pt",
    ]
    # the main file holds no optimizer state, only the marker
    main = torch.load(ckpt, weights_only=False)
    assert "state" not in main["optimizer_states"][0]

    converted = torch.load(
        convert_sharded_checkpoint(ckpt, tmp_path / "plain.ckpt"), weights_only=False
    )
    want = torch.load(nodes / "sync_plain.ckpt", weights_only=False)["optimizer_states"][0]
    got = converted["optimizer_states"][0]
    assert [{k: v for k, v in g.items()} for g in got["param_groups"]] == want["param_groups"]
    assert set(got["state"]) == set(want["state"]) and len(want["state"]) == 2 * 4
    for i, st in want["state"].items():
        for k, v in st.items():
            assert rel_err(got["state"][i][k], v) <= 1e-6, (i, k)

    # bf16 module: the fp32 masters, in the nodes' shards, come back into the section
    separate = convert_sharded_checkpoint(
        nodes / "separate_sharded.ckpt", tmp_path / "separate.ckpt"
    )
    got_masters = torch.load(separate, weights_only=False)["roundpipe"]["masters"]
    assert (
        torch.load(nodes / "separate_sharded.ckpt", weights_only=False)["roundpipe"]["masters"]
        == {}
    )  # (the file holds none: each is in its owner's shard)
    plain_ckpt = torch.load(nodes / "separate_plain.ckpt", weights_only=False)
    want_masters = plain_ckpt["roundpipe"]["masters"]
    assert set(got_masters) == set(want_masters) and len(want_masters) == 2 * 4
    for k, v in want_masters.items():
        assert v.dtype == torch.float32 and rel_err(got_masters[k], v) <= 1e-6, k

    # resumed by one process (another rank count) on the whole batches: as the 2 nodes
    model = Lit()
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
    trainer(RESUMED_STEPS, 1, shard=True, mode="sync").fit(model, loader, ckpt_path=ckpt)
    two_nodes = torch.load(nodes / "sync_sharded_rank0.pt")["resumed"]
    for k, v in model.net.state_dict().items():
        assert rel_err(v, two_nodes[k]) <= 1e-5, k


def test_an_async_step_is_accepted_with_sharding() -> None:
    from roundpipe_lightning import RoundPipeFabricStrategy, RoundPipeStrategy

    for cls in (RoundPipeStrategy, RoundPipeFabricStrategy):
        assert cls(shard_host_state=True, async_step=True).async_step is True
        assert cls(shard_host_state=True).settings.async_step is None  # None: the hardware's
        assert cls(shard_host_state=True, async_step=False).async_step is False
        assert cls(async_step=True).async_step is True  # unsharded: as asked


def test_sixteen_mixed_is_refused_with_sharding() -> None:
    from roundpipe_lightning.strategy import check_shardable

    with pytest.raises(ValueError, match="shard_host_state=True.*16-mixed.*bf16-mixed"):
        check_shardable(True, object())
    check_shardable(False, object())  # unsharded: the scaler is fine
    check_shardable(True, None)  # sharded without a scaler: fine


def test_removing_a_checkpoint_removes_its_shards(tmp_path: Path) -> None:
    """``ModelCheckpoint(save_top_k=...)`` drops old checkpoints through
    ``strategy.remove_checkpoint``: a sharded one's ``.shards/`` goes with the file."""
    from roundpipe_lightning import RoundPipeStrategy
    from roundpipe_lightning.sharded_checkpoint import shards_dir

    ckpt = tmp_path / "epoch=0.ckpt"
    torch.save({"x": 1}, ckpt)
    shard = shards_dir(ckpt, 0) / "shard-00000-of-00002.pt"
    shard.parent.mkdir(parents=True)
    torch.save({}, shard)
    keep = tmp_path / "epoch=1.ckpt.shards"  # another checkpoint's shards stay
    keep.mkdir()
    strategy = RoundPipeStrategy()
    strategy.remove_checkpoint(ckpt)
    assert not ckpt.exists() and not Path(f"{ckpt}.shards").exists()
    assert keep.is_dir()
    strategy.remove_checkpoint(tmp_path / "epoch=1.ckpt")  # no file, no error
    assert not keep.exists()
