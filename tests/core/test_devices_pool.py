"""The device pool and worker threads: job lifetimes, start-up failures, settings."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from roundpipe_core.running.devices import cpu as cpu_mod
from roundpipe_core.running.devices import pool as pool_mod
from roundpipe_core.running.devices.base import WorkerStartError
from roundpipe_core.running.devices.cpu import CPUWorker
from roundpipe_core.running.devices.pool import DevicePool

# Taken at import, before any fixture routes CPU workers to (fake) CUDA: these tests
# are about the CPU worker and the pool themselves.
_resolve_devices = pool_mod.resolve_devices


@pytest.fixture(autouse=True)
def _cpu_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "resolve_devices", _resolve_devices)


class Payload:
    """Something a job holds (stands in for a bound method of a RoundPipe, or tensors)."""

    def __init__(self) -> None:
        self.data = torch.zeros(16)


def _freed(ref: weakref.ref, timeout: float = 5.0) -> bool:
    """Whether ``ref`` dies within ``timeout`` (the worker clears its locals right after
    completing the future the caller waited on, so give it a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        if ref() is None:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.fixture
def pool():
    p = DevicePool("cpu:2")
    yield p
    p.close()


def test_a_job_is_freed_after_it_ran(pool: DevicePool) -> None:
    payload = Payload()
    ref = weakref.ref(payload)
    seen = []

    def run_queue(worker: Any, jobs: list[Any]) -> None:
        seen.extend(type(j).__name__ for j in jobs)

    pool.run([[payload], []], run_queue)
    assert seen == ["Payload"]
    del payload
    # The idle worker keeps nothing of the last job: neither its queue (the payload)
    # nor its callable (in the engine, a bound method holding the whole RoundPipe).
    assert _freed(ref), gc.get_referrers(ref())


def test_a_bound_method_job_does_not_keep_its_owner(pool: DevicePool) -> None:
    class Owner:
        def run_queue(self, worker: Any, jobs: list[Any]) -> None:
            pass

    owner = Owner()
    ref = weakref.ref(owner)
    pool.run([[1], [2]], owner.run_queue)
    del owner
    assert _freed(ref)


def test_a_failed_job_its_tensors_and_frames_are_freed(pool: DevicePool) -> None:
    payload = Payload()
    ref = weakref.ref(payload)

    def run_queue(worker: Any, jobs: list[Any]) -> None:
        held = jobs[0]  # a local of the failing frame: the traceback keeps it
        raise RuntimeError(f"job failed holding {type(held).__name__}")

    with pytest.raises(RuntimeError, match="job failed holding Payload"):
        pool.run([[payload], []], run_queue)
    del payload
    assert _freed(ref)


def test_a_roundpipe_dropped_without_close_is_freed_with_its_threads() -> None:
    from torch import nn

    from roundpipe_core import RoundPipe

    rp = RoundPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), devices="cpu:2")
    rp.forward_backward(
        (torch.randn(4, 8),), label=torch.randn(4, 8), loss_fn=lambda o, t: ((o - t) ** 2).sum()
    )
    threads = [w._thread for w in rp.pool.workers]
    ref = weakref.ref(rp)
    del rp
    assert _freed(ref), "the RoundPipe is still referenced after its last call"
    for t in threads:
        t.join(5)
        assert not t.is_alive()


def test_jobs_still_run_in_order_and_results_reach_the_caller(pool: DevicePool) -> None:
    order: list[int] = []
    futs = [pool.workers[0].submit(order.append, i) for i in range(20)]
    for f in futs:
        assert f.result(timeout=10) is None
    assert order == list(range(20))


# ---------------------------------------------------------------------------
# a worker whose thread set-up raises
# ---------------------------------------------------------------------------
class _FailingStart(CPUWorker):
    gate: threading.Event | None = None

    def _thread_init(self) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        raise OSError("no such device")


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_pool_with_a_worker_that_cannot_start_raises_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[CPUWorker] = []

    def make(index: int) -> CPUWorker:
        w = (_FailingStart if index == 1 else CPUWorker)(index)
        made.append(w)
        return w

    monkeypatch.setattr(pool_mod, "CPUWorker", make)
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match="could not start.*OSError: no such device"):
        DevicePool("cpu:3")
    assert time.monotonic() - t0 < 10
    # nothing half-built: the workers that did start were stopped again
    for w in made:
        w._thread.join(5)
        assert not w._thread.is_alive()


def test_jobs_given_to_a_worker_that_failed_to_start_fail_promptly() -> None:
    gate = threading.Event()
    worker = type("Gated", (_FailingStart,), {"gate": gate})(0)
    try:
        queued = worker.submit(lambda: "ran")  # queued while the thread is still starting
        gate.set()
        with pytest.raises(WorkerStartError, match="OSError: no such device") as info:
            queued.result(timeout=5)
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(WorkerStartError):
            worker.wait_started(5)
        with pytest.raises(WorkerStartError):
            worker.submit(lambda: "ran")  # later jobs: refused at once
    finally:
        worker.close()


def test_pool_run_raises_instead_of_hanging_when_a_worker_died_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool that skipped the start-up check still fails fast: every queue the dead
    worker was given fails with the start error, which ``run`` raises."""
    monkeypatch.setattr(pool_mod.Worker, "wait_started", lambda self, timeout=0: None)
    monkeypatch.setattr(
        pool_mod, "CPUWorker", lambda i: (_FailingStart if i == 0 else CPUWorker)(i)
    )
    p = DevicePool("cpu:2")
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerStartError):
            p.run([[1], [2]], lambda w, q: None)
        assert time.monotonic() - t0 < 10
    finally:
        p.close()


# ---------------------------------------------------------------------------
# ROUNDPIPE_CPU_DEVICE_MEMORY_GB
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan", "inf", "1e-12"])
def test_bad_cpu_device_memory_setting_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("ROUNDPIPE_CPU_DEVICE_MEMORY_GB", raw)
    with pytest.raises(ValueError, match=f"ROUNDPIPE_CPU_DEVICE_MEMORY_GB={raw!r}.*positive"):
        cpu_mod.cpu_device_memory_bytes()
    # refused when the pool is built, before any compute
    with pytest.raises(ValueError, match="ROUNDPIPE_CPU_DEVICE_MEMORY_GB"):
        DevicePool("cpu:1")


def test_cpu_device_memory_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROUNDPIPE_CPU_DEVICE_MEMORY_GB", raising=False)
    assert cpu_mod.cpu_device_memory_bytes() == 8 * 1024**3
    monkeypatch.setenv("ROUNDPIPE_CPU_DEVICE_MEMORY_GB", " 0.5 ")
    p = DevicePool("cpu:2")
    try:
        assert p.memory_capacity() == 512 * 1024**2
    finally:
        p.close()
