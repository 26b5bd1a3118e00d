"""CUDAWorker on fake CUDA: copies land late, so a missing wait on any channel is caught;
error paths of the worker (ledger, memory capacity) and of host registration.

These run on a machine without a GPU (the fake is refused where one is visible).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from roundpipe_core.running.devices import cuda as cuda_mod
from roundpipe_core.running.devices import memory
from roundpipe_core.running.devices.base import WorkerStartError

# Taken at import: the fake_cuda fixture replaces registration with a no-op for engine tests.
_register = memory._register

pytestmark = pytest.mark.skipif(
    memory.cuda_available(), reason="fake CUDA is for machines without a GPU"
)


@pytest.fixture
def make_worker(fake_cuda: type):
    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        w = fake_cuda(len(made), torch.device("cuda", 0), **kwargs)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def _on(worker: Any, fn: Any) -> Any:
    return worker.submit(fn).result(timeout=30)


# ---------------------------------------------------------------------------
# the fake catches a missing wait on each channel
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "channel,inflight", [("activation", 2), ("param", 2), ("param", 0)], ids=str
)
def test_an_upload_is_visible_only_after_its_wait(make_worker, channel: str, inflight: int) -> None:
    worker = make_worker(param_inflight_chunks=inflight)
    host = [torch.arange(40, dtype=torch.float32), torch.arange(7)]

    def job() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dev = worker.copy_in(host, channel)
        before = [d.clone() for d in dev]  # what compute would read without a wait
        worker.wait_channel(channel)
        after = [d.clone() for d in dev]
        worker.release(dev, channel)
        return before, after

    before, after = _on(worker, job)
    # Without the wait the last piece has not landed (the feeder may already have
    # waited for earlier pieces to keep its depth): NaN / an invalid index there.
    assert torch.isnan(before[0][-1]), before[0]
    assert before[1][-1] == torch.iinfo(torch.int64).min
    for a, h in zip(after, host):
        assert torch.equal(a, h)
    assert worker.ledger.current[channel] == 0


def test_a_download_is_complete_only_after_its_event(make_worker) -> None:
    worker = make_worker()
    src = torch.arange(12, dtype=torch.float32)

    def job() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        outs, done = worker.copy_out_async([src])
        early = outs[0].clone()
        done.synchronize()
        return early, outs[0].clone(), worker.copy_out([src])

    early, late, blocking = _on(worker, job)
    assert torch.isnan(early).all()
    assert torch.equal(late, src) and torch.equal(blocking[0], src)


def test_a_download_is_ordered_after_the_compute_issued_before_it(make_worker) -> None:
    """A download reads what the compute stream made: its stream waits for an event
    recorded on the compute stream before it copies (on a GPU the copy could otherwise
    run before the kernels writing its source). The fake computes on the worker thread
    at once, so a download cannot read a half-made tensor here: the wait itself is
    what can be checked."""
    worker = make_worker()
    src = torch.arange(12, dtype=torch.float32)

    def job() -> list[Any]:
        before = len(worker.download_stream.waited)
        outs, done = worker.copy_out_async([src])
        done.synchronize()
        assert torch.equal(outs[0], src)
        return worker.download_stream.waited[before:]

    waits = _on(worker, job)
    assert any(ev._stream is worker.compute_stream for ev in waits), (
        "the download stream never waited for the compute stream"
    )


def test_copies_nobody_waits_for_still_land(make_worker) -> None:
    """As on a GPU, a copy completes by itself eventually (the drainer), and an
    event's query() turns true then."""
    worker = make_worker()
    src = torch.ones(5)
    outs, done = _on(worker, lambda: worker.copy_out_async([src]))
    deadline = threading.Event()
    for _ in range(100):
        if done.query():
            break
        deadline.wait(0.05)
    assert done.query() and torch.equal(outs[0], src)


# ---------------------------------------------------------------------------
# worker error paths
# ---------------------------------------------------------------------------
def test_failed_parameter_submission_leaves_nothing_in_the_ledger(make_worker, monkeypatch) -> None:
    worker = make_worker()

    def refuse(srcs: Any, outs: Any) -> int:
        raise RuntimeError("the parameter feeder is closed")

    monkeypatch.setattr(worker, "_submit_param", refuse)
    with pytest.raises(RuntimeError, match="feeder is closed"):
        _on(worker, lambda: worker.copy_in([torch.ones(100)], "param"))
    assert worker.ledger.current.get("param", 0) == 0


@pytest.mark.parametrize("channel", ["param", "activation"])
def test_out_of_memory_midway_through_an_upload_leaves_nothing_in_the_ledger(
    make_worker, monkeypatch: pytest.MonkeyPatch, channel: str
) -> None:
    worker = make_worker()
    make = type(worker)._new_device_tensor
    calls = []

    def oom_on_second(self: Any, like: torch.Tensor) -> torch.Tensor:
        calls.append(like.shape)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("fake: CUDA out of memory")
        return make(self, like)

    monkeypatch.setattr(type(worker), "_new_device_tensor", oom_on_second)
    with pytest.raises(torch.OutOfMemoryError):
        _on(worker, lambda: worker.copy_in([torch.ones(10), torch.ones(20)], channel))
    assert worker.ledger.current.get(channel, 0) == 0


def test_memory_capacity_is_free_plus_reserved_shared_by_workers_of_one_gpu(
    make_worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 6 * gib)
    # less what the caching allocator may reserve above allocations on the worker's streams
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    reserve = memory.allocator_reserve_bytes()
    assert reserve == 4 * 4 * 1024**2  # 4 streams x (a small-pool segment + a page)
    first = make_worker()
    assert first.memory_capacity() == 16 * gib - reserve
    second = make_worker()  # a second worker on the same GPU
    assert first.memory_capacity() == second.memory_capacity() == 8 * gib - reserve
    second.close()
    assert first.memory_capacity() == 16 * gib - reserve
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # no expandable
    assert memory.allocator_reserve_bytes() == 4 * 22 * 1024**2
    assert first.memory_capacity() == 16 * gib - 4 * 22 * 1024**2

    class Props:
        total_memory = 24 * gib

    def refuse(d: Any = None) -> tuple[int, int]:
        raise RuntimeError("no context yet")

    monkeypatch.setattr(torch.cuda, "mem_get_info", refuse)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: Props())
    assert first.memory_capacity() == 24 * gib - memory.allocator_reserve_bytes()


def test_a_cuda_worker_whose_thread_cannot_select_its_gpu_fails_the_pool(
    fake_cuda: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    from roundpipe_core.running.devices.pool import DevicePool

    def refuse(device: Any) -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    with pytest.raises(WorkerStartError, match="invalid device ordinal"):
        DevicePool(["cuda:0", "cuda:0"])
    assert cuda_mod._DEVICE_USERS[0] == 0  # the workers that were made are closed again


# ---------------------------------------------------------------------------
# cudaHostRegister / cudaHostUnregister
# ---------------------------------------------------------------------------
class FakeCudart:
    """Host registration with the CUDA runtime's rules: overlapping ranges are refused
    with error 712, and every failed call becomes the thread's "last error"."""

    def __init__(self, fail_register: int = 0, fail_unregister: int = 0) -> None:
        self.ranges: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.last_error = 0
        self.refused = 0
        self.fail_register = fail_register
        self.fail_unregister = fail_unregister

    def _fail(self, code: int) -> int:
        self.refused += 1
        self.last_error = code
        return code

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        if self.fail_register:
            return self._fail(self.fail_register)
        for a, n in self.ranges.items():
            if ptr < a + n and a < ptr + size:
                return self._fail(712)
        self.ranges[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        if self.fail_unregister or ptr not in self.ranges:
            return self._fail(self.fail_unregister or 713)
        del self.ranges[ptr]
        return 0

    def cudaGetLastError(self) -> int:
        err, self.last_error = self.last_error, 0
        return err


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def _groups(*tensors: torch.Tensor) -> list:
    return memory._storage_groups(list(tensors))


def test_register_and_release_balance_and_page_align(cudart: FakeCudart) -> None:
    page = memory.page_size()
    t = torch.ones(3 * page // 4 + 5)
    handle = _register(_groups(t))
    try:
        assert handle.registered and all(
            p % page == 0 and n % page == 0 for p, n in handle.registered
        )
        assert memory.registered_ranges() == sorted(handle.registered)
    finally:
        handle.release()
    assert cudart.ranges == {} and memory.registered_ranges() == []
    handle.release()  # idempotent


class _Span:
    """Stands in for a storage: only its address range matters to registration."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self._ptr, self._nbytes = ptr, nbytes

    def data_ptr(self) -> int:
        return self._ptr

    def nbytes(self) -> int:
        return self._nbytes


def test_second_registration_of_the_same_pages_registers_only_the_rest(
    cudart: FakeCudart,
) -> None:
    page = memory.page_size()
    first = _register([(_Span(10 * page, 2 * page), [])])
    try:
        second = _register([(_Span(9 * page + 7, 5 * page - 7), [])])
        try:
            # the overlap was seen before calling CUDA: no call was refused
            assert cudart.refused == 0
            assert second.registered == [(9 * page, page), (12 * page, 2 * page)]
            assert second.nbytes == 3 * page
        finally:
            second.release()
        assert memory.registered_ranges() == [(10 * page, 2 * page)]
    finally:
        first.release()
    assert cudart.ranges == {}


def test_already_registered_by_someone_else_is_skipped_and_the_error_cleared(
    cudart: FakeCudart,
) -> None:
    t = torch.ones(1000)
    page = memory.page_size()
    start = t.untyped_storage().data_ptr() // page * page
    cudart.ranges[start] = page  # registered behind our back: error 712 when we try
    handle = _register(_groups(t))
    try:
        assert cudart.refused == 1 and start not in dict(handle.registered)
        assert cudart.last_error == 0, "a skipped 712 must not stay CUDA's last error"
    finally:
        handle.release()


def test_register_failure_releases_what_it_registered_and_clears_the_error(
    cudart: FakeCudart,
) -> None:
    cudart.fail_register = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaHostRegister failed with CUDA error 2"):
        _register(_groups(torch.ones(10)))
    assert cudart.last_error == 0 and memory.registered_ranges() == []


def test_unregister_failure_is_reported(cudart: FakeCudart) -> None:
    handle = _register(_groups(torch.ones(10), torch.ones(5000)))
    cudart.fail_unregister = 1
    with pytest.raises(RuntimeError, match="cudaHostUnregister failed for .* CUDA error 1"):
        handle.release()
    assert memory.registered_ranges() == [] and not handle.registered
    assert cudart.last_error == 0


def test_page_size_comes_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "sysconf", lambda name: 65536)
    assert memory.page_size() == 65536
    spans = [(65536 + 10, 100), (65536 + 5000, 10)]
    assert memory.page_ranges(spans) == [(65536, 65536)]  # one 64 KiB page, not two 4 KiB ones

    def no_sysconf(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    assert memory.page_size() == 4096


def test_uncovered_parts_of_a_range() -> None:
    taken = [(100, 50), (200, 10), (300, 100)]
    assert memory._uncovered(0, 100, taken) == [(0, 100)]
    assert memory._uncovered(120, 200, taken) == [(150, 50), (210, 90)]
    assert memory._uncovered(320, 50, taken) == []
    assert memory._uncovered(0, 500, []) == [(0, 500)]
    assert memory._uncovered(390, 20, taken) == [(400, 10)]


# ---------------------------------------------------------------------------
# shutdown order: drain the queue, issue the feeder's units, finish the copies
# ---------------------------------------------------------------------------
def test_an_upload_queued_before_close_still_runs(make_worker) -> None:
    worker = make_worker()
    host = torch.arange(64, dtype=torch.float32)
    started = threading.Event()

    def job() -> torch.Tensor:
        started.wait(5)
        dev = worker.copy_in([host], "param")
        worker.wait_channel("param")
        return dev[0].clone()

    fut = worker.submit(job)
    started.set()
    worker.close()  # the job is still queued or running: its feeder must outlive it
    assert torch.equal(fut.result(timeout=30), host)
    assert worker.drained


def test_close_unregisters_host_memory_only_after_its_copies_ran(
    fake_cuda: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch import nn

    from roundpipe_core import RoundPipe
    from roundpipe_core.running.devices.pool import DevicePool

    # the fake worker computes on CPU memory, so its pool does not pin by itself
    monkeypatch.setattr(DevicePool, "is_cuda", property(lambda self: True))

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    rp = RoundPipe(model, devices=["cuda:0"], pin_model="register")
    assert memory.registered_ranges(), "the weights were registered"
    worker = rp.pool.workers[0]
    weights = [p.detach() for p in model.parameters()]
    # a prefetch nobody waited for: its copies still read the registered weights
    _on(worker, lambda: worker.copy_in(weights, "param"))
    rp.close()  # the fake runtime refuses an unregister under a queued copy
    assert memory.registered_ranges() == []


# ---------------------------------------------------------------------------
# downloads: one bounded pinned staging buffer per worker, pageable results
# ---------------------------------------------------------------------------
def test_a_download_larger_than_the_staging_buffer_arrives_whole(make_worker) -> None:
    worker = make_worker(download_staging_bytes=128)
    srcs = [torch.arange(100, dtype=torch.float32), torch.arange(3), torch.ones(2, 0)]
    outs = _on(worker, lambda: worker.copy_out(srcs))
    for o, s in zip(outs, srcs):
        assert torch.equal(o, s)
    # the staging buffer holds one piece (plus alignment), not the whole download
    staging = worker._downloads.staging
    assert staging is not None and staging.numel() <= 128 + 2 * 64


def test_gradients_come_back_pageable_and_pinned_memory_stays_bounded(
    fake_cuda: type, fake_pinned: Any
) -> None:
    from torch import nn

    from roundpipe_core import RoundPipe

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ref = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 64), torch.randn(6, 64)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reserved_before = fake_pinned.reserved
    rp = RoundPipe(model, devices=["cuda:0", "cuda:0"], pin_model="off")
    try:

        def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
            return ((out - label) ** 2).sum()  # a sum: the microbatches add up to the batch

        for _ in range(2):
            rp.forward_backward((x,), label=y, loss_fn=loss_fn)
        rp.synchronize()
        growth = fake_pinned.reserved - reserved_before
        # per worker one staging block (512 bytes + alignment: 1 or 2 KiB) and the lazy ring
        assert growth <= 2 * (2048 + 1024) < grad_bytes / 4, (growth, grad_bytes)
        staging = [w._downloads.staging for w in rp.pool.workers]
        staging = [s for s in staging if s is not None]
        assert staging, "downloads went through the staging buffer"
        staging_ptrs = {s.untyped_storage().data_ptr() for s in staging}
        loss = loss_fn(ref(x), y) * 2
        loss.backward()
        got = dict(rp.optim_named_parameters())
        for n, p in ref.named_parameters():
            g = got[n].grad
            assert g.untyped_storage().data_ptr() not in staging_ptrs
            # fp32 rounding of gradients of size ~10, summed in another order
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5, msg=n)
    finally:
        rp.close()


def test_gradient_downloads_reuse_memory_only_once_nobody_holds_it(fake_cuda: type) -> None:
    from torch import nn

    from roundpipe_core import RoundPipe

    torch.manual_seed(0)
    rp = RoundPipe(
        nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]),
        devices=["cuda:0", "cuda:0"],
        pin_model="off",
    )
    x, y = torch.randn(4, 32), torch.randn(4, 32)
    masters = [p for _, p in rp.optim_named_parameters()]

    def call() -> list[torch.Tensor]:
        for p in masters:
            p.grad = None  # zero_grad(set_to_none=True)
        rp.forward_backward((x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        rp.synchronize()
        return [p.grad for p in masters]

    try:
        first = call()
        values = [g.clone() for g in first]
        second = call()  # the first call's gradients are still held here
        for a, b, v in zip(first, second, values):
            assert torch.equal(a, v), "a held gradient was overwritten"
            assert a.data_ptr() != b.data_ptr()
            assert torch.equal(b, v)
        ptrs = {g.data_ptr() for g in first + second}
        del first, second
        third = call()
        assert {g.data_ptr() for g in third} <= ptrs  # written again, not fresh memory
        for g, v in zip(third, values):
            assert torch.equal(g, v)
    finally:
        rp.close()


def test_a_cuda_pool_asks_for_expandable_segments_unless_configured(
    fake_cuda: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from roundpipe_core.running.devices.pool import DevicePool

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    DevicePool(["cuda:0"]).close()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # the user's
    assert not memory.default_allocator_settings()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late to set
    assert not memory.default_allocator_settings()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


# ---------------------------------------------------------------------------
# host syncs: none per microbatch where nothing needs the result at once
# ---------------------------------------------------------------------------
def test_a_one_stage_call_waits_on_the_gpu_a_fixed_number_of_times(
    fake_cuda: type, host_syncs: Any
) -> None:
    """A microbatch's loss is not waited for inside the microbatch (the worker's queue
    completes the deferred downloads at its end), so the host syncs of a one-stage
    call do not grow with the microbatches."""
    from torch import nn

    from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(12, 8), torch.randn(12, 2)
    rp = RoundPipe(model, devices=["cuda:0"], pin_model="off")
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [], [range(0, 3)]
    syncs, losses = {}, {}
    try:
        rp.layer_activation_bytes = [0.0] * 3  # no measuring forward in the count
        for m in (2, 6, 2):
            cfg = RoundPipeRunConfig(num_microbatch=m, execute_plan=plan)
            before = host_syncs()
            losses[m] = rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
            syncs[m] = host_syncs() - before
    finally:
        rp.close()
    assert syncs[6] == syncs[2] <= 2, syncs  # the deferred losses and the gradients: once each
    with torch.no_grad():
        ref = _sum_sq(model(x), y)  # the host model holds the weights the calls used
    torch.testing.assert_close(losses[6], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[2], ref, rtol=1e-5, atol=1e-5)


def _sum_sq(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).sum()


# ---------------------------------------------------------------------------
# buffer write-back is fenced like weights: no upload still reading them
# ---------------------------------------------------------------------------
def test_batchnorm_write_back_waits_for_uploads_reading_the_buffers(fake_cuda: type) -> None:
    """The forward stage of layers 0-1 writes BatchNorm statistics back while its worker
    has prefetched the same layers' backward stage; the fake fails the test if the
    prefetch's copies were still queued when the statistics changed (a torn read on a
    GPU), and the statistics must equal plain PyTorch's."""
    import copy

    from torch import nn

    from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 16), nn.BatchNorm1d(16)
    )
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 16)
    rp = RoundPipe(model, devices=["cuda:0", "cuda:0"], pin_model="off")
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [range(0, 2)], [range(2, 4), range(0, 2)]
    try:
        rp.layer_activation_bytes = [0.0] * 4
        cfg = RoundPipeRunConfig(num_microbatch=1, execute_plan=plan)
        rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
        rp.synchronize()
    finally:
        rp.close()
    _sum_sq(ref(x), y).backward()
    for i in (1, 3):
        torch.testing.assert_close(model[i].running_mean, ref[i].running_mean)
        torch.testing.assert_close(model[i].running_var, ref[i].running_var)


# ---------------------------------------------------------------------------
# dropout replay across GPU models
# ---------------------------------------------------------------------------
class _Props:
    def __init__(self, name: str, sms: int) -> None:
        self.name, self.multi_processor_count, self.total_memory = name, sms, 24 << 30


@pytest.mark.parametrize("mixed", [True, False], ids=["3090+4090", "two-4090"])
def test_unequal_sm_counts_warn_once_when_recompute_replays_randomness(
    fake_cuda: type, monkeypatch: pytest.MonkeyPatch, mixed: bool
) -> None:
    import warnings

    from torch import nn

    from roundpipe_core import RoundPipe

    gpus = [_Props("RTX 3090", 82), _Props("RTX 4090", 128 if mixed else 82)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[int(i)])
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    rp = RoundPipe(model, devices=["cuda:0", "cuda:1"], pin_model="off")
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                rp.forward_backward((x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        replay = [w for w in seen if "different SM counts" in str(w.message)]
        assert len(replay) == (1 if mixed else 0), [str(w.message) for w in seen]
    finally:
        rp.close()
