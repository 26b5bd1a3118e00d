"""The planner's memory model against a caching allocator: fake CUDA whose device memory is
a ``FakeCachingAllocator`` (tests/fake_device_memory.py) with a capacity that raises
``torch.OutOfMemoryError``. Each test needs fake CUDA and asks for it (``fake_cuda``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fake_device_memory import FakeCachingAllocator
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.planning.profile import check_plan_fits, profile_of

MiB = 1024**2


def _sum_sq(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).sum()


# -- the allocator itself -----------------------------------------------------------------
def _alloc(allocator: FakeCachingAllocator, nbytes: int, stream: object) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    allocator.track(t.untyped_storage(), stream)
    return t


def test_a_freed_block_serves_only_its_own_stream_without_expandable_segments() -> None:
    a, b = object(), object()
    alloc = FakeCachingAllocator(64 * MiB, expandable=False)
    t = _alloc(alloc, 4 * MiB, a)  # a 20 MiB segment of stream a
    assert alloc.reserved == 20 * MiB
    del t
    u = _alloc(alloc, 4 * MiB, a)  # stream a reuses its cached block
    assert alloc.reserved == 20 * MiB
    v = _alloc(alloc, 4 * MiB, b)  # stream b cannot: a segment of its own
    assert alloc.reserved == 40 * MiB
    del u, v
    assert alloc.snapshot()["allocated"] == 0 and alloc.reserved == 40 * MiB  # cached


def test_past_capacity_the_cache_is_released_first_then_oom() -> None:
    a, b = object(), object()
    alloc = FakeCachingAllocator(30 * MiB, expandable=False)
    t = _alloc(alloc, 12 * MiB, a)
    del t  # 12 MiB cached for stream a
    u = _alloc(alloc, 24 * MiB, b)  # over capacity with the cache: released, then fits
    assert alloc.reserved == 24 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="fake CUDA out of memory"):
        _alloc(alloc, 24 * MiB, a)
    del u


def test_expandable_segments_map_pages_any_stream_may_reuse() -> None:
    a, b = object(), object()
    alloc = FakeCachingAllocator(16 * MiB, expandable=True)
    t = _alloc(alloc, 3 * MiB, a)
    assert alloc.reserved == 4 * MiB  # two 2 MiB pages, not a 20 MiB segment
    del t
    u = _alloc(alloc, 15 * MiB, b)  # a's pages were unmapped: b maps them
    assert alloc.snapshot()["reserved"] == 16 * MiB
    del u


# -- the planner against it ---------------------------------------------------------------
WIDTH = 2048  # 16 MiB weights: the accumulated gradient outweighs the allocator's slack


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)])


def _plans() -> list[ModelExecutePlan]:
    one, two = ModelExecutePlan(), ModelExecutePlan()
    one.fwd_plan, one.bwd_plan = [], [range(0, 3)]
    two.fwd_plan, two.bwd_plan = [range(0, 2)], [range(2, 3), range(0, 2)]
    return [one, two]


@pytest.fixture
def large_copies(fake_cuda: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """MiB-sized upload pieces and download staging: megabyte tensors in 96-byte pieces
    would take minutes."""
    monkeypatch.setattr(fake_cuda, "fake_param_chunk_bytes", 4 * MiB)
    monkeypatch.setattr(fake_cuda, "fake_download_staging_bytes", 4 * MiB)


def _smallest_accepted_device(plan: ModelExecutePlan, rp: RoundPipe, device_memory: Any) -> int:
    """The least device memory (bytes) with which the pool's capacity passes the planner's
    fit check for ``plan``: found by bisection, so the test restates neither the planner's
    formula nor how a worker derives its capacity from the device's memory."""
    prof = profile_of(rp)
    lo, hi = 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        device_memory(mid)
        try:
            check_plan_fits(plan, prof, "fused", rp.pool.memory_capacity())
            hi = mid
        except ValueError:
            lo = mid + 1
    return lo


@pytest.mark.parametrize("plan_index", [0, 1], ids=["one-stage", "two-stage"])
def test_a_plan_the_planner_accepts_runs_within_the_device_memory(
    fake_device_memory: Any, large_copies: None, plan_index: int
) -> None:
    """The device gets the least memory with which the planner accepts the plan; two
    microbatches accumulate gradients. The caching allocator runs out of memory here when
    ``check_plan_fits`` leaves out the gradient being accumulated, or when
    ``CUDAWorker.memory_capacity`` leaves out what the allocator reserves on top."""
    plan = _plans()[plan_index]
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    fake_device_memory(1 << 40)  # the first call measures the activations on a large device
    rp = RoundPipe(_model(), devices=["cuda:0"], pin_model="off")
    try:
        cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
        rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
        rp.synchronize()
        total = _smallest_accepted_device(plan, rp, fake_device_memory)
        allocator = fake_device_memory(total)
        for _ in range(2):
            rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
        rp.synchronize()
        snap = allocator.snapshot()
        # nothing stays allocated on the device between calls (the parameter feeder once
        # kept its last batch's device tensors until the next upload)
        assert snap["allocated"] == 0, snap
        peak = snap["peak_reserved"]
    finally:
        rp.close()
    assert 0 < peak <= total
    if plan_index == 0:
        # nothing is prefetched in a one-stage plan: the model is not loose by much either
        # (with several stages the check counts a prefetch that round-robin may schedule)
        assert allocator.peak_allocated > 0.8 * total, (allocator.peak_allocated, total)


def test_a_stage_larger_than_the_device_is_refused_or_runs_out_of_memory(
    fake_device_memory: Any, large_copies: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-stage plan holds 3 weights of 16 MiB, their gradients and one more being
    added: ~112 MiB. On a 64 MiB device the planner refuses it before any compute; with
    the fit check removed, the allocator raises ``torch.OutOfMemoryError`` (the error a
    GPU gives), which reaches the caller, and the next call on a large device works."""
    from roundpipe_core import checks

    plan = _plans()[0]
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    rp = RoundPipe(_model(), devices=["cuda:0"], pin_model="off")
    try:
        rp.layer_activation_bytes = [0.0] * 3
        fake_device_memory(64 * MiB)
        with pytest.raises(ValueError, match="needs .* on its device"):
            rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
        monkeypatch.setattr(checks, "check_plan_fits", lambda *args, **kwargs: None)
        with pytest.raises(Exception) as caught:
            rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
        chain, err = [], caught.value
        while err is not None:
            chain.append(err)
            err = err.__cause__ or err.__context__
        assert any(isinstance(e, torch.OutOfMemoryError) for e in chain), chain
        fake_device_memory(1 << 40)
        loss = rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
        assert torch.isfinite(loss)
    finally:
        rp.close()
