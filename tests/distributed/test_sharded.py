"""``DataParallel(shard_host_state=True)``: 2 and 4 processes on 127.0.0.1 (gloo).

* Same numbers: after several AdamW steps with gradient accumulation and clipping by
  the global norm, the sharded weights equal the unsharded data-parallel ones within
  1e-6 (relative), with shared masters (fp32) and with separate ones (a bf16 model, fp32
  masters: the masters within 1e-6, every rank's weights its owner's master rounded),
  and asynchronously (separate fp32 masters, sharded too: one step stale, as
  unsharded). A synchronous attach refuses an asynchronous step, naming the fix.
* Memory: each rank's masters + optimizer state (counted in bytes) are 1/N of the
  unsharded ones (+5 %), synchronous and asynchronous, the shards add up to the whole,
  and the gradients a rank keeps after the reduction are its share only.
* Faults: a rank that dies mid-backward ends the others with an error naming them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import launch, rel_err, wait_all  # noqa: E402

import roundpipe_core.distributed as D  # noqa: E402

pytestmark = pytest.mark.host_only

WORKER = Path(__file__).with_name("_shard_worker.py")
PG_TIMEOUT_S = 10.0
STARTUP_ALLOWANCE_S = 60.0  # four processes importing torch on a loaded 2-core box
MAX_NORM = 0.05  # as _shard_worker.MAX_NORM
BLOCKS = 8  # as _shard_worker.BLOCKS: trainable tensors = 2 * BLOCKS
MODES = ("sync", "separate", "async")


def _fail_with_logs(procs, why: str) -> None:
    logs = "\n".join(f"--- rank {p.rank} ---\n{p.output()[-4000:]}" for p in procs)
    pytest.fail(f"{why}\n{logs}")


@pytest.fixture(scope="session", params=[2, 4], ids=["2ranks", "4ranks"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    world = request.param
    out = tmp_path_factory.mktemp(f"sharded{world}")
    procs = launch("equiv", out, world=world, timeout_s=PG_TIMEOUT_S, worker=WORKER)
    codes = wait_all(procs, STARTUP_ALLOWANCE_S + 60)
    if codes != [0] * world:
        _fail_with_logs(procs, f"exit codes {codes} (None = killed after the deadline)")
    infos = [json.loads((out / f"info_rank{r}.json").read_text()) for r in range(world)]
    return world, out, infos


def _load(out: Path, name: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}_rank{rank}.pt")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_sharded_weights_equal_unsharded(trained, mode: str) -> None:
    world, out, infos = trained
    plain = _load(out, f"{mode}_plain", 0)
    plain_masters = _load(out, f"{mode}_plain_masters", 0)
    # the masters the ranks hold together: separate ones each on one rank only (shared
    # ones are the weights, on every rank)
    shares = [_load(out, f"{mode}_sharded_masters", r) for r in range(world)]
    held: dict[str, torch.Tensor] = {}
    for share in shares:
        if mode in ("separate", "async"):
            assert not set(share) & set(held), f"{mode}: a master is held by two ranks"
            assert share, f"{mode}: rank holds no master"
        held.update(share)
    assert set(held) == set(plain_masters)
    for k in plain_masters:
        err = rel_err(held[k], plain_masters[k])
        assert err <= 1e-6, f"{mode}: master {k} rel err {err:.2e} vs unsharded"
    for rank in range(world):
        sharded = _load(out, f"{mode}_sharded", rank)
        assert set(sharded) == set(plain)
        for k in plain:
            assert torch.equal(sharded[k], _load(out, f"{mode}_sharded", 0)[k]), (
                f"{mode}: {k} differs between rank 0 and rank {rank}"
            )
            if k in held:  # every rank's weight is its owner's master, rounded once
                assert torch.equal(sharded[k], held[k].to(sharded[k].dtype)), (mode, rank, k)
            tol = 1e-6 if sharded[k].dtype == torch.float32 else 2**-7  # one bf16 ulp
            err = rel_err(sharded[k], plain[k])
            assert err <= tol, f"{mode}, rank {rank}: {k} rel err {err:.2e} vs unsharded"
        assert infos[rank][f"{mode}_sharded"]["in_sync"]
    # not vacuous: every step clipped, by the same global norm as unsharded
    for rank in range(world):
        norms = infos[rank][f"{mode}_sharded"]["norms"]
        ref = infos[rank][f"{mode}_plain"]["norms"]
        assert min(norms) > 10 * MAX_NORM
        assert norms == pytest.approx(ref, rel=1e-6)


@pytest.mark.timeout(240)
def test_async_sharded_is_one_step_stale(trained) -> None:
    """The asynchronous run computes with weights one step stale: its norms from the
    second step on differ from the synchronous run's, the first step's do not; sharded
    as unsharded (the equality above), with the masters other ranks own released."""
    world, _, infos = trained
    sync, stale = infos[0]["sync_sharded"]["norms"], infos[0]["async_sharded"]["norms"]
    assert sync[0] == pytest.approx(stale[0], rel=1e-6)
    assert all(abs(a - b) > 1e-3 for a, b in zip(sync[1:], stale[1:]))
    for rank in range(world):
        owned = infos[rank]["async_sharded"]["owned"]
        assert infos[rank]["async_sharded"]["released"] == 2 * BLOCKS - owned > 0
        assert infos[rank]["separate_sharded"]["released"] > 0


@pytest.mark.timeout(240)
def test_async_step_is_refused_where_masters_are_sharded(trained) -> None:
    """The released masters' values reach the model inside the step: an asynchronous
    step would write them under the next call, so it is refused, naming the fixes."""
    world, _, infos = trained
    for rank in range(world):
        why = infos[rank]["separate_sharded"]["async_refused"]
        assert "pass is_async=False" in why and "async_step=False" in why, why
        assert "attach(rp, optimizers, async_step=True)" in why, why


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_each_rank_holds_its_share_of_the_state(trained, mode: str) -> None:
    world, _, infos = trained
    whole = infos[0][f"{mode}_plain"]["bytes"]
    shares = [infos[r][f"{mode}_sharded"]["bytes"] for r in range(world)]
    bound = 1 / world + 0.05
    whole_state = whole["optimizer_state"] + whole["separate_masters"]
    for rank, b in enumerate(shares):
        assert b["optimizer_state"] <= bound * whole["optimizer_state"], (rank, b, whole)
        assert b["grads_after_reduce"] <= bound * whole["grads_after_reduce"], (rank, b, whole)
        # masters + optimizer state: this rank's share (none of their own if shared)
        assert b["optimizer_state"] + b["separate_masters"] <= bound * whole_state, b
        if mode != "sync":
            assert b["separate_masters"] <= bound * whole["separate_masters"], (b, whole)
        # the host-memory budget's lines for this rank (state_shards=N) predict them
        assert abs(b["optimizer_state"] / b["budget_optimizer_state"] - 1) <= 0.05, b
        assert abs(b["separate_masters"] - b["budget_masters"]) <= 0.05 * whole_state, b
    assert sum(b["optimizer_state"] for b in shares) == whole["optimizer_state"]
    assert sum(infos[r][f"{mode}_sharded"]["owned"] for r in range(world)) == 16
    # the collectives' flat buffers, sharded and not: made once, the same every step
    # (glibc would keep per-step ones in its heaps), and exactly what the budget's line says
    for b in [*shares, whole]:
        assert b["kept_buffers"] > 0 and b["buffers_reused"], b
        assert b["kept_buffers"] == b["budget_kept_buffers"], b
    assert (whole["separate_masters"] == 0) == (mode == "sync")


def test_partition_is_contiguous_and_balanced_by_bytes() -> None:
    sizes = [70, 20, 110, 110, 110, 110, 33, 5, 300, 7]
    params = [torch.zeros(n) for n in sizes]
    for world in (1, 2, 3, 4):
        owners = D.partition_by_bytes(params, world)
        assert owners == sorted(owners) and set(owners) <= set(range(world))
        total = sum(sizes) * 4
        for rank in range(world):
            share = sum(n * 4 for n, o in zip(sizes, owners) if o == rank)
            # whole tensors: off the ideal by at most half the largest tensor at each cut
            assert abs(share - total / world) <= max(sizes) * 4, (world, owners)
    assert D.partition_by_bytes([torch.zeros(10)] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="world_size"):
        D.partition_by_bytes(params, 0)
    with pytest.raises(TypeError, match="shard_host_state"):
        D.DataParallel(shard_host_state="yes")  # type: ignore[arg-type]


#: the failure scenarios, all launched at once (each waits for the process-group timeout)
FAILURES = {
    "dead": {"FAIL_RANK": "1"},
    "stall-sync": {"FAIL_RANK": "1", "FAIL_MODE": "stall_in_step", "MODE": "sync"},
    "stall-async": {"FAIL_RANK": "1", "FAIL_MODE": "stall_in_step", "MODE": "async"},
}


@pytest.fixture(scope="session")  # session: set up once per xdist worker
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list, list]]:
    """Each failure scenario's folder, processes and rank 0's exit code (``None``: still
    running at the deadline, killed). They run side by side: each spends most of its time
    waiting for the timeout, not computing."""
    launched = {}
    for name, env in FAILURES.items():
        out = tmp_path_factory.mktemp(name)
        launched[name] = (
            out,
            launch("kill", out, world=2, timeout_s=PG_TIMEOUT_S, worker=WORKER, extra_env=env),
        )
    results = {}
    for name, (out, procs) in launched.items():
        try:
            codes = wait_all(procs[:1], STARTUP_ALLOWANCE_S + PG_TIMEOUT_S + 30)
        finally:
            wait_all(procs, 0.1)  # kills a stalled rank
        results[name] = (out, procs, codes + [procs[1].popen.returncode])
    return results


@pytest.mark.timeout(240)
def test_dead_rank_ends_the_sharded_job_naming_the_survivor(failures) -> None:
    out, procs, codes = failures["dead"]
    if codes[0] is None:
        _fail_with_logs(procs, "rank 0 still running after its peer died: it hangs")
    assert codes[1] == 17, codes
    assert (out / "peer_died").exists()
    log = procs[0].output()
    assert codes[0] != 0
    assert "failed on rank 0 of 2: a peer process may have died" in log, log[-3000:]
    assert not (out / "rank0_finished").exists()


def _union(out: Path, name: str, world: int) -> dict[str, torch.Tensor]:
    held: dict[str, torch.Tensor] = {}
    for rank in range(world):
        held.update(_load(out, name, rank))
    return held


#: the rank counts each mode's 2-rank checkpoint is resumed on
RESUME_WORLDS = {"sync": (2, 1, 4), "separate": (2, 1), "async": (2, 1, 4)}


@pytest.fixture(scope="session")  # session: set up once per xdist worker
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks save one shard each in every mode, then every mode resumes on each of its
    rank counts: one launch per rank count serves all the modes."""
    root = tmp_path_factory.mktemp("sharded_ckpt")
    (root / "save").mkdir()
    procs = launch(
        "ckpt",
        root / "save",
        world=2,
        timeout_s=PG_TIMEOUT_S,
        worker=WORKER,
        extra_env={"CKPT_DIR": str(root / "shards"), "MODE": ",".join(MODES)},
    )
    if wait_all(procs, STARTUP_ALLOWANCE_S + 90) != [0, 0]:
        _fail_with_logs(procs, "saving run failed")
    for world in (2, 1, 4):
        modes = [m for m in MODES if world in RESUME_WORLDS[m]]
        out = root / f"resume{world}"
        out.mkdir()
        procs = launch(
            "ckpt",
            out,
            world=world,
            timeout_s=PG_TIMEOUT_S,
            worker=WORKER,
            extra_env={"CKPT_DIR": str(root / "shards"), "RESUME": "1", "MODE": ",".join(modes)},
        )
        if wait_all(procs, STARTUP_ALLOWANCE_S + 90) != [0] * world:
            _fail_with_logs(procs, f"resume on {world} ranks failed")
    return root


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", MODES)
def test_sharded_checkpoint_resumes_on_any_rank_count(checkpoints: Path, mode: str) -> None:
    """2 ranks save one shard each; the 2-rank resume is bit-exact, 1 and 4 ranks restore
    the state exactly and continue within 1e-6; a corrupted shard is named by its rank.
    ``separate``: a bf16 model whose fp32 masters are sharded too (each shard holds its
    rank's masters, restored exactly wherever they are owned now); ``async``: separate
    fp32 masters stepping asynchronously, sharded as ``separate`` (loading broadcasts
    each owner's into every rank's model weights)."""
    ckpt = checkpoints / "shards" / mode
    saved = checkpoints / "save" / mode
    assert sorted(f.name for f in ckpt.iterdir()) == [
        "shard-00000-of-00002.pt",
        "shard-00001-of-00002.pt",
    ]
    continued = _load(saved, "continued", 0)
    continued_masters = _union(saved, "continued_masters", 2)
    for world in RESUME_WORLDS[mode]:
        out = checkpoints / f"resume{world}" / mode
        entries = 0
        for rank in range(world):
            info = json.loads((out / f"ckpt_info_rank{rank}.json").read_text())
            assert info["restored_exactly"], (world, rank)
            entries += info["state_entries"]
            resumed = _load(out, "resumed", rank)
            for k, v in continued.items():
                if world == 2:
                    assert torch.equal(resumed[k], v), f"{k}: 2-rank resume is not bit-exact"
                elif mode != "separate":
                    assert rel_err(resumed[k], v) <= 1e-6, (world, k)
                # (separate, another rank count: a bf16 model's gradients of another
                # batch split differ by bf16 rounding, ~1e-3; the restored state is
                # checked exactly above, masters, weights and optimizer state)
        resumed_masters = _union(out, "resumed_masters", world)
        assert set(resumed_masters) == set(continued_masters)
        for k, v in continued_masters.items():
            if world == 2:
                assert torch.equal(resumed_masters[k], v), f"{k}: master not bit-exact"
            elif mode != "separate":
                assert rel_err(resumed_masters[k], v) <= 1e-6, (world, k)
        assert entries == 16  # every parameter's state, each on one rank only

    # a damaged shard (in a copy: the other modes' checks read these): the error names
    # the rank that wrote it
    ckpt = Path(shutil.copytree(ckpt, checkpoints / f"damaged_{mode}"))
    bad = ckpt / "shard-00001-of-00002.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    rp_params: dict[str, torch.Tensor] = {}
    with pytest.raises(ValueError, match="shard of rank 1"):
        D.merge_shards(ckpt)
    bad.unlink()
    with pytest.raises(ValueError, match="rank 1 of 2 is missing"):
        D.load_shards(ckpt, rp_params, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rank_stalled_in_its_step_ends_the_all_gather_at_the_timeout(failures, mode: str) -> None:
    """The all-gather runs on a group of its own, on the optimizer thread: a peer that
    stalls inside its step must still end the others at the process-group timeout.
    Asynchronous, the survivor goes on to the next iteration: whichever collective waits
    for the stalled rank first (the next reduction, or the publication) ends it."""
    out, procs, codes = failures[f"stall-{mode}"]
    if codes[0] is None:
        _fail_with_logs(procs, "rank 0 still running after its peer stalled: it hangs")
    assert (out / "peer_stalled").exists()
    log = procs[0].output()
    assert codes[0] != 0
    assert "failed on rank 0 of 2: a peer process may have died or stalled" in log, log[-3000:]
    if mode == "sync":
        assert "all-gather of the updated weights (rank " in log, log[-3000:]
    assert not (out / "rank0_finished").exists()
