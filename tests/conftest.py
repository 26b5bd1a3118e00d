"""Shared test helpers: run engine tests on every kind of device this machine has.

An engine test that takes the ``pool_devices`` fixture runs once per device
kind: ``[cpu]`` everywhere, ``[cuda]`` where a GPU is visible (marked
``cuda``, skipped without one)::

    def test_matches_pytorch(pool_devices):
        rp = RoundPipe(make_model(), devices=pool_devices(3))
        ...

``pool_devices(n)`` returns ``"cpu:n"`` for CPU workers, and for CUDA ``n``
devices spread round-robin over the visible GPUs (``[cuda:0, cuda:0, cuda:0]``
on a one-GPU machine): several workers may share one GPU, each with its own
streams, so the same 2- and 3-device schedules run on a single H200.

Select by kind with markers: ``pytest -m cuda`` runs only the CUDA variants
(and the CUDA-only tests), ``pytest -m "not cuda"`` only the CPU ones.

``ROUNDPIPE_TEST_DEVICE=cuda`` runs the *whole* suite on GPUs, tests written
for CPU workers included: every CPU worker a test asks for (``"cpu:N"``, an
int, ``None``) becomes a CUDA worker, spread round-robin over the visible GPUs.
``benchmarks/gpu_check.sh`` uses it.

``ROUNDPIPE_TEST_DEVICE=fake-cuda`` does the same on a machine without a GPU:
the CUDA calls are faked (streams, events, devices) and the "device memory" is
CPU memory, so the whole suite runs through ``CUDAWorker``'s own logic
(chunked parameter feeder, upload tickets, events, ledger, RNG, per-GPU lock).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch


def cuda_device_count() -> int:
    """Visible GPUs; 0 without CUDA. Never raises."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver means no GPU for the tests
        return 0


HAS_CUDA = cuda_device_count() > 0
TEST_DEVICE = os.environ.get("ROUNDPIPE_TEST_DEVICE", "").strip().lower()
ROUTE_TO_CUDA = TEST_DEVICE == "cuda"
FAKE_CUDA = TEST_DEVICE == "fake-cuda"

DEVICE_KINDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


def make_pool_devices(kind: str, n: int, gpus: int | None = None) -> Any:
    """The ``devices`` argument for ``n`` workers of ``kind`` ("cpu" or "cuda").

    Args:
        kind: "cpu" or "cuda".
        n: number of workers.
        gpus: GPUs to spread CUDA workers over (default: all visible).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if kind == "cpu":
        return f"cpu:{n}"
    if kind == "cuda":
        count = cuda_device_count() if gpus is None else gpus
        if count < 1:
            raise ValueError("no CUDA GPU is visible")
        return [torch.device("cuda", i % count) for i in range(n)]
    raise ValueError(f"kind must be 'cpu' or 'cuda', got {kind!r}")


def pytest_report_header(config: pytest.Config) -> str:
    route = (
        " (ROUNDPIPE_TEST_DEVICE=cuda: CPU workers run as CUDA workers)" if ROUTE_TO_CUDA else ""
    )
    return f"roundpipe: {cuda_device_count()} CUDA GPU(s) visible{route}"


def pytest_configure(config: pytest.Config) -> None:
    # GPU results are compared with CPU / plain PyTorch at fp32 tolerance: no TF32.
    if TEST_DEVICE not in ("", "cpu", "cuda", "fake-cuda"):
        raise pytest.UsageError(
            f"ROUNDPIPE_TEST_DEVICE must be cpu, cuda or fake-cuda, got {TEST_DEVICE!r}"
        )
    if ROUTE_TO_CUDA and not HAS_CUDA:
        raise pytest.UsageError("ROUNDPIPE_TEST_DEVICE=cuda but no CUDA GPU is visible")
    if FAKE_CUDA and HAS_CUDA:
        raise pytest.UsageError("ROUNDPIPE_TEST_DEVICE=fake-cuda is for machines without a GPU")
    if HAS_CUDA:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=DEVICE_KINDS)
def device_kind(request: pytest.FixtureRequest) -> str:
    """ "cpu" or "cuda": parametrises a test over the device kinds."""
    return request.param


@pytest.fixture
def pool_devices(device_kind: str) -> Callable[[int], Any]:
    """``pool_devices(n)`` -> the ``devices`` argument for ``n`` workers of this test's kind."""
    return lambda n: make_pool_devices(device_kind, n)


@pytest.fixture(autouse=True)
def _route_all_to_cuda(request: pytest.FixtureRequest) -> None:
    if FAKE_CUDA:
        request.getfixturevalue("fake_cuda")
    if ROUTE_TO_CUDA or FAKE_CUDA:
        request.getfixturevalue("route_cpu_workers_to_cuda")


@pytest.fixture
def route_cpu_workers_to_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each CPU worker a pool would make becomes a CUDA worker (ROUNDPIPE_TEST_DEVICE=cuda)."""
    from roundpipe_core.devices import pool

    original = pool.resolve_devices

    def cpu_default() -> int:
        getter = getattr(pool, "_cpu_count_from_env", None)
        return getter() if getter else int(os.environ.get("ROUNDPIPE_CPU_DEVICES", "2"))

    def routed(devices: Any) -> list[torch.device]:
        # A count (or the default) means "that many workers", as on CPU, even where
        # there are fewer GPUs: workers then share GPUs.
        count = cuda_device_count()
        if devices is None or (
            isinstance(devices, int) and not isinstance(devices, bool) and devices > 0
        ):
            n = cpu_default() if devices is None else devices
            return [torch.device("cuda", i % count) for i in range(n)]
        devs = original(devices)
        k = 0
        out = []
        for d in devs:
            if d.type == "cpu":
                d = torch.device("cuda", k % count)
                k += 1
            out.append(d)
        return out

    monkeypatch.setattr(pool, "resolve_devices", routed)


# -- fake CUDA: CUDAWorker's logic on CPU memory ----------------------------------
class _FakeStream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.priority = priority
        self.waited: list[_FakeEvent] = []

    def wait_event(self, event: _FakeEvent) -> None:
        assert event.recorded, "a stream waits on an event that was never recorded"
        self.waited.append(event)


class _FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False
        self.t = 0.0

    def record(self, stream: _FakeStream | None = None) -> None:
        self.recorded, self.t = True, time.perf_counter()

    def synchronize(self) -> None:
        assert self.recorded, "synchronize() on an event that was never recorded"

    def query(self) -> bool:
        return self.recorded

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.t - self.t) * 1000.0


def _cpu_backed_worker_class() -> type:
    from roundpipe_core.devices.cuda import CUDAWorker

    class CPUBackedCUDAWorker(CUDAWorker):
        """CUDAWorker whose "device memory" is CPU memory: the CUDA calls are faked,
        the worker's own logic (feeder, chunking, tickets, ledger, RNG, locks) is real.
        Tiny parameter chunks so that every upload goes through several feeder units."""

        def __init__(self, index: int, device: torch.device) -> None:
            super().__init__(
                index, device, param_chunk_bytes=96, param_inflight_chunks=2, pin_downloads=False
            )
            # Model code sees where its tensors really are (layers that move
            # temporaries to ``device`` must find CPU memory there).
            self.device = torch.device("cpu")

        def _new_device_tensor(self, like: torch.Tensor) -> torch.Tensor:
            return torch.empty(like.shape, dtype=like.dtype)

    return CPUBackedCUDAWorker


CPUBackedCUDAWorker = _cpu_backed_worker_class()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> type:
    """Pretend one GPU exists; CUDA workers become ``CPUBackedCUDAWorker`` (returned)."""
    from roundpipe_core.devices import cuda as cuda_mod
    from roundpipe_core.devices import memory

    c = torch.cuda
    monkeypatch.setattr(c, "is_available", lambda: True)
    monkeypatch.setattr(c, "device_count", lambda: 1)
    monkeypatch.setattr(c, "Stream", _FakeStream)
    monkeypatch.setattr(c, "Event", _FakeEvent)
    monkeypatch.setattr(c, "stream", lambda s: nullcontext())
    monkeypatch.setattr(c, "device", lambda d: nullcontext())
    monkeypatch.setattr(c, "set_device", lambda d: None)
    monkeypatch.setattr(c, "set_stream", lambda s: None)
    monkeypatch.setattr(c, "synchronize", lambda d=None: None)
    monkeypatch.setattr(c, "get_rng_state", lambda d=None: torch.get_rng_state())
    monkeypatch.setattr(c, "set_rng_state", lambda s, d=None: torch.set_rng_state(s))
    monkeypatch.setattr(c, "mem_get_info", lambda d=None: (8 << 30, 16 << 30))
    monkeypatch.setattr(cuda_mod, "CUDAWorker", CPUBackedCUDAWorker)
    # pin_model: "alloc" still packs the weights into slabs (of ordinary memory);
    # "register" has no host registry to call.
    pack = memory.pack_module_tensors
    monkeypatch.setattr(
        memory,
        "pack_module_tensors",
        lambda tensors, pin, slab_bytes=memory.DEFAULT_SLAB_BYTES: pack(tensors, False, slab_bytes),
    )
    monkeypatch.setattr(memory, "_register", lambda groups: memory.PinHandle(mode="register"))
    return CPUBackedCUDAWorker
