"""Two processes on 127.0.0.1 as two "nodes" (gloo, CPU backend, 2 workers each).

* The parameters after N steps (``is_async=False``) are identical on both ranks and
  equal, within 1e-5 relative, to plain PyTorch trained on the concatenated batch --
  for mean and sum reduction, with and without overlap, with gradient accumulation
  and with an autograd ``loss.backward()`` through the pipeline; ranks start from
  different weights that ``broadcast_masters`` makes equal.
* The reducer's flat buffers: a ring of ``REDUCE_IN_FLIGHT + 1`` per dtype kept across
  steps (not a copy of every gradient), whatever the number of buckets, and exactly the
  bytes ``DataParallel.kept_buffer_bytes`` gives the host-memory budget.
* A rank that dies mid-backward makes the other fail with an error; a rank that
  stalls makes the other fail at the process-group timeout. Nothing hangs: every
  process is waited on with a hard deadline and killed past it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import build_model, launch, reference_run, rel_err, wait_all  # noqa: E402

from roundpipe_core.distributed.buckets import REDUCE_IN_FLIGHT  # noqa: E402

pytestmark = pytest.mark.host_only

PG_TIMEOUT_S = 10.0
# Process start-up (importing torch on a loaded 2-core box) plus the run itself.
STARTUP_ALLOWANCE_S = 45.0

TRAIN_CONFIGS = {  # must match _worker.TRAIN_CONFIGS: name -> accumulation steps
    "mean_overlap_small_buckets": 1,
    "mean_overlap_tiny_buckets_accum2": 2,
    "sum_no_overlap_accum2": 2,
    "mean_overlap_accum2_autograd": 2,
    "sum_overlap_one_bucket": 1,
    "dataparallel_mean_overlap_accum2": 2,
}
STEPS = 3


def _fail_with_logs(procs, why: str) -> None:
    logs = "\n".join(f"--- rank {p.rank} ---\n{p.output()[-4000:]}" for p in procs)
    pytest.fail(f"{why}\n{logs}")


@pytest.fixture(scope="session")  # session: set up once per xdist worker
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_train")
    procs = launch("train", out, timeout_s=PG_TIMEOUT_S)
    codes = wait_all(procs, STARTUP_ALLOWANCE_S + 45)
    if codes != [0, 0]:
        _fail_with_logs(
            procs, f"training processes exited with {codes} (None = killed after the deadline)"
        )
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(TRAIN_CONFIGS))
def test_ranks_identical_and_equal_to_single_process(trained: Path, name: str) -> None:
    p0 = torch.load(trained / f"{name}_rank0.pt")
    p1 = torch.load(trained / f"{name}_rank1.pt")
    ref = reference_run(STEPS, TRAIN_CONFIGS[name])
    init = dict(build_model(0).named_parameters())
    assert set(p0) == set(ref) == set(p1)
    for k in ref:
        assert torch.equal(p0[k], p1[k]), f"{name}: {k} differs between the ranks"
        err = rel_err(p0[k], ref[k])
        assert err <= 1e-5, (
            f"{name}: {k} rel err {err:.2e} vs single-process PyTorch on the whole batch"
        )
    # the comparison is not vacuous: training moved the trainable weights, the frozen layer stayed
    assert max((p0[k] - init[k]).abs().max().item() for k in ref if init[k].requires_grad) > 1e-2
    assert torch.equal(p0["2.weight"], init["2.weight"].detach())


@pytest.mark.timeout(150)
def test_overlap_is_driven_by_the_grad_hook(trained: Path) -> None:
    info = json.loads((trained / "info_rank0.json").read_text())
    for name in (
        "mean_overlap_small_buckets",
        "mean_overlap_tiny_buckets_accum2",
        "mean_overlap_accum2_autograd",
        "sum_overlap_one_bucket",
        "dataparallel_mean_overlap_accum2",
    ):
        # every bucket of every armed step was released by the hook during the backward call
        assert info[name]["hook_ready"] == info[name]["buckets"] * STEPS, (name, info[name])
        assert info[name]["in_sync"]
    assert (
        info["mean_overlap_small_buckets"]["buckets"] > 3
    )  # several buckets, issued in a fixed order
    assert info["sum_no_overlap_accum2"]["hook_ready"] == 0


@pytest.mark.timeout(150)
def test_missing_gradients_take_part_as_zeros_and_params_select(trained: Path) -> None:
    for rank in (0, 1):
        g = torch.load(trained / f"none_grads_rank{rank}.pt")
        assert torch.equal(g["g0"], torch.full_like(g["g0"], 1.5))  # mean of 1 and 2
        assert g["g1"] is not None and torch.equal(
            g["g1"], torch.full_like(g["g1"], 0.5)
        )  # mean of 1 and "none"
        assert g["g2_is_none"]  # no rank had one: stays None, as in one process
        assert torch.equal(
            g["g3"], torch.full_like(g["g3"], float(rank))
        )  # not in params: untouched
        assert torch.equal(
            g["outside"], torch.full_like(g["outside"], 2.0)
        )  # a non-RoundPipe tensor: reduced


@pytest.mark.timeout(150)
def test_collectives_and_misuse(trained: Path) -> None:
    for rank in (0, 1):
        info = json.loads((trained / f"info_rank{rank}.json").read_text())
        c = info["collectives"]
        assert c["mean"] == [0.5, 5.0]
        assert c["sum"] == [3]
        assert c["max"] == [1.0]
        assert c["gather"] == [[0.0, 1.0, 0.0], [0.0, 1.0, 2.0]]  # unequal sizes, zero-padded
        assert c["obj"] == {"from": 0, "list": [0]}
        assert "arm() must come right before the LAST backward" in info["misuse_error"]


@pytest.mark.timeout(150)
def test_the_reducer_touches_gradients_under_the_masters_lock(trained: Path) -> None:
    """While the masters' grad lock is held (as ``synchronize()`` holds it handing the
    gradients to the model) the reduction waits, then completes (1 + 2 on every rank)."""
    for rank in (0, 1):
        got = json.loads((trained / f"info_rank{rank}.json").read_text())["grad_lock"]
        assert got == {"waited": True, "finished": True, "reduced": True}, (rank, got)


@pytest.mark.timeout(150)
def test_reducer_keeps_a_ring_of_flat_buffers_not_a_gradient_copy(trained: Path) -> None:
    """Over every step, the collectives reduce at most ``REDUCE_IN_FLIGHT + 1`` distinct
    flat buffers per dtype, kept (the same ones every step, still held after the last),
    each no larger than the largest bucket, far less than one buffer per bucket -- and
    the configurations above, many buckets included, still equal one process."""
    slots = REDUCE_IN_FLIGHT + 1
    for rank in (0, 1):
        info = json.loads((trained / f"info_rank{rank}.json").read_text())
        for name in TRAIN_CONFIGS:
            b = info[name]["buffers"]
            assert 0 < b["storages_used"] <= slots * b["dtypes"], (name, b)
            assert b["storage_bytes_used"] <= slots * b["dtypes"] * b["largest_bucket_bytes"]
            # what the collectives used is what the reducer still holds, and what it is
            # predicted to hold (DataParallel.kept_buffer_bytes: the budget's line)
            assert b["kept_bytes"] == b["storage_bytes_used"] == b["predicted_bytes"], (name, b)
        for name in ("mean_overlap_tiny_buckets_accum2", "dataparallel_mean_overlap_accum2"):
            many = info[name]
            assert many["buckets"] > slots, many  # every slot reused within a step
            assert many["buffers"]["storages_used"] == slots, many
            assert many["buffers"]["kept_bytes"] < many["buffers"]["all_buckets_bytes"], many
        assert info["mean_overlap_tiny_buckets_accum2"]["buckets"] >= 3 * slots


def _wait_for_marker(procs, survivor, path: Path, deadline_s: float) -> float:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if path.exists() and path.read_text():
            return time.monotonic()
        if survivor.popen.poll() is not None:
            break
        time.sleep(0.1)
    wait_all(procs, 0.1)
    _fail_with_logs(procs, f"{path.name} never appeared")
    raise AssertionError  # unreachable


@pytest.mark.timeout(150)
def test_failed_rank_ends_the_job_within_the_timeout(tmp_path: Path) -> None:
    """Rank 0 (which also hosts the rendezvous store) dies inside its backward
    (``kill``), or rank 1 stops taking part while alive (``stall``): the other rank must
    exit with the reducer's error within the process-group timeout (plus slack for a
    loaded machine), not hang. Both jobs run at once."""
    failing = {"kill": 0, "stall": 1}
    jobs = {}
    for mode, rank in failing.items():
        (tmp_path / mode).mkdir()
        jobs[mode] = launch(
            mode, tmp_path / mode, timeout_s=PG_TIMEOUT_S, extra_env={"FAIL_RANK": str(rank)}
        )
    try:
        for mode, procs in jobs.items():
            survivor = procs[1 - failing[mode]]
            marker = tmp_path / mode / ("peer_died" if mode == "kill" else "peer_stalled")
            _wait_for_marker(procs, survivor, marker, STARTUP_ALLOWANCE_S + 30)
            code = wait_all([survivor], PG_TIMEOUT_S + 20)[0]
            log = survivor.output()
            if code is None:
                _fail_with_logs(
                    procs,
                    f"{mode}: rank {survivor.rank} still running {PG_TIMEOUT_S + 20:.0f} s "
                    f"after rank {failing[mode]} failed: it hangs",
                )
            assert code != 0, mode
            assert f"gradient all-reduce failed on rank {survivor.rank} of 2" in log, log[-3000:]
            assert not (tmp_path / mode / f"rank{survivor.rank}_finished").exists()
    finally:
        for procs in jobs.values():
            wait_all(procs, 0.1)  # kills whatever still runs (the stalled rank)
    assert jobs["kill"][0].popen.returncode == 17
