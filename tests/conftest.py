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
Fake copies land late and fresh buffers hold NaN, so a missing wait on any
channel (parameter upload, activation upload, download) gives wrong numbers.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from fake_device_memory import CURRENT, DeviceAllocations, FakeCachingAllocator, host_side
from fake_gpu_rng import FakeGpuRng
from torch.multiprocessing.reductions import StorageWeakRef


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
def concurrent_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan CPU workers as if they computed at the same time, as GPUs do: for the tests
    of the pipelining planner and of multi-stage default plans, which a CPU pool would
    otherwise plan as one stage (its workers compute one at a time)."""
    from roundpipe_core.running.devices.pool import DevicePool

    monkeypatch.setattr(DevicePool, "concurrent", property(lambda self: True))


@pytest.fixture
def pool_devices(device_kind: str) -> Callable[[int], Any]:
    """``pool_devices(n)`` -> the ``devices`` argument for ``n`` workers of this test's kind."""
    return lambda n: make_pool_devices(device_kind, n)


@pytest.fixture(autouse=True)
def _no_source_races() -> Any:
    """Fail a test during which a fake-CUDA copy's host source changed before it ran."""
    FAKE_SOURCE_RACES.clear()
    yield
    races, FAKE_SOURCE_RACES[:] = list(FAKE_SOURCE_RACES), []
    assert not races, f"host sources changed under pending copies: {races[:3]}"


#: Device workers started in this process so far (``Worker.__init__`` calls), for the
#: ``host_only`` check below.
_WORKERS_STARTED = [0]


def _count_worker_starts() -> None:
    from roundpipe_core.running.devices.base import Worker

    if getattr(Worker.__init__, "_counted", False):
        return
    original = Worker.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        _WORKERS_STARTED[0] += 1
        original(self, *args, **kwargs)

    counted._counted = True  # type: ignore[attr-defined]
    Worker.__init__ = counted  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _host_only_starts_no_worker(request: pytest.FixtureRequest) -> Any:
    """A test marked ``host_only`` is left out of the fake-CUDA stage of ``.ci/run``
    (``-m "not host_only"``), so it must not reach device code: it fails here if it
    started a device worker in this process (its own child processes may)."""
    _count_worker_starts()
    before = _WORKERS_STARTED[0]
    yield
    started = _WORKERS_STARTED[0] - before
    record = os.environ.get("ROUNDPIPE_RECORD_WORKER_STARTS")
    if record:  # which tests start workers: where the host_only marker may go
        with open(record, "a") as fh:
            fh.write(f"{request.node.nodeid}\t{started}\n")
    if started and request.node.get_closest_marker("host_only") is not None:
        pytest.fail(
            f"{request.node.nodeid} is marked host_only but started {started} device "
            "worker(s) in the test process: remove the marker, so that the fake-CUDA "
            "stage runs it through the CUDA worker's code"
        )


@pytest.fixture(autouse=True)
def _route_all_to_cuda(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("cpu_backend") is not None:
        return  # a test of the CPU backend itself keeps its CPU workers
    if FAKE_CUDA:
        request.getfixturevalue("fake_cuda")
    if ROUTE_TO_CUDA or FAKE_CUDA:
        request.getfixturevalue("route_cpu_workers_to_cuda")


#: the repository this suite belongs to; no test may leave files in it
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what tools write while the suite runs (bytecode, tool caches, the docs build)
_TOOL_OUTPUT = {
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",  # hypothesis's example database
    ".git",
    "site",
}


def repository_entries(root: str = REPO_ROOT) -> set[str]:
    """Every file and folder under ``root`` (relative paths), tool output left out."""
    entries: set[str] = set()
    for folder, subfolders, files in os.walk(root):
        # A virtual environment (.venv, CI's .ci-venv) holds tens of thousands of files:
        # walking it twice per test cost about 0.3 s a test, a third of the suite's time.
        subfolders[:] = [
            d
            for d in subfolders
            if d not in _TOOL_OUTPUT
            and not d.endswith(".egg-info")
            and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg"))
        ]
        rel = os.path.relpath(folder, root)
        # coverage's data files (pytest --cov with -n: a worker that is done writes its own)
        files = [f for f in files if not f.startswith(".coverage")]
        entries.update(os.path.normpath(os.path.join(rel, name)) for name in files + subfolders)
    return entries


@pytest.fixture(autouse=True)
def _writes_nothing_into_the_repository(request: pytest.FixtureRequest) -> Any:
    """A test writes under ``tmp_path`` (a Trainer: ``default_root_dir=tmp_path`` or
    ``enable_checkpointing=False``), never into the repository: Lightning's default
    ``checkpoints/`` folder lands in the working directory."""
    before = repository_entries()
    yield
    new = sorted(repository_entries() - before)
    if new:
        pytest.fail(
            f"{request.node.nodeid} wrote into the repository: {new[:5]}; write under "
            "tmp_path instead (Trainer(default_root_dir=tmp_path), ModelCheckpoint(dirpath=...))"
        )


@pytest.fixture
def route_cpu_workers_to_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each CPU worker a pool would make becomes a CUDA worker (ROUNDPIPE_TEST_DEVICE=cuda)."""
    from roundpipe_core.running.devices import pool

    original = pool.resolve_devices

    def cpu_default() -> int:
        getter = getattr(pool, "_cpu_count", None)
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

    # every module that imported the function by name (the presets count devices with it)
    import sys

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("roundpipe") and (
            getattr(module, "resolve_devices", None) is original
        ):
            monkeypatch.setattr(module, "resolve_devices", routed)


# -- fake CUDA: CUDAWorker's logic on CPU memory ----------------------------------
#: A copy nobody waits for still lands after this long (a real GPU finishes it too);
#: code that reads sooner without waiting sees the fill pattern instead of the data.
FAKE_COPY_DELAY_S = 0.25


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped like ``like`` whose contents betray a read before its copy landed:
    NaN for floating point, the dtype's minimum (an invalid index) for integers."""
    if like.dtype.is_floating_point or like.dtype.is_complex:
        return torch.full(like.shape, float("nan"), dtype=like.dtype)
    if like.dtype == torch.bool:
        return torch.ones(like.shape, dtype=torch.bool)
    return torch.full(like.shape, torch.iinfo(like.dtype).min, dtype=like.dtype)


class _FakeStream:
    """A CUDA stream played on the CPU.

    Copies issued on it (``CUDAWorker._copy_on``) do not run when issued: they run
    when an event recorded after them is waited on (``Event.synchronize``, or a
    ``wait_event`` of the compute stream), or ``FAKE_COPY_DELAY_S`` after issue
    (a background drainer) — as late as a real GPU may run them. The compute
    stream is the worker's own thread: nothing is queued on it, and its
    ``wait_event`` blocks that thread until the event's copies have run.
    """

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.priority = priority
        self.waited: list[_FakeEvent] = []
        self._lock = threading.RLock()
        self._ops: collections.deque[tuple[int, float, Callable[[], None], list[Span]]] = (
            collections.deque()
        )
        self._issued = 0
        self._done = 0
        _DRAINER.watch(self)

    def enqueue(self, op: Callable[[], None], touches: Sequence[Span] = ()) -> None:
        """Queue ``op``; ``touches`` are the ``(address, nbytes)`` host ranges it reads or
        writes (what a real DMA would), for the checks of host-memory lifetime."""
        with self._lock:
            self._issued += 1
            self._ops.append((self._issued, time.monotonic(), op, list(touches)))

    def pending_touch(self, start: int, nbytes: int) -> bool:
        """Whether a copy not run yet touches host memory in ``[start, start + nbytes)``."""
        with self._lock:
            return any(
                a < start + nbytes and start < a + n for *_, spans in self._ops for a, n in spans
            )

    def mark(self) -> int:
        """Position of the last operation issued so far (what an event recorded now waits for)."""
        with self._lock:
            return self._issued

    def done(self, seq: int) -> bool:
        with self._lock:
            return self._done >= seq

    def run_until(self, seq: int) -> None:
        with self._lock:
            while self._ops and self._ops[0][0] <= seq:
                n, _, op, _ = self._ops.popleft()
                op()
                self._done = n

    def run_due(self, issued_before: float) -> None:
        with self._lock:
            while self._ops and self._ops[0][1] <= issued_before:
                self.run_until(self._ops[0][0])

    def wait_event(self, event: _FakeEvent) -> None:
        assert event.recorded, "a stream waits on an event that was never recorded"
        self.waited.append(event)
        with self._lock:
            if self._ops:  # later work on this stream runs after the event

                def waited() -> None:
                    event.run_copies()
                    # copies queued behind this wait may read what the event's copies
                    # wrote (an upload from a download's pinned piece): their sources
                    # are theirs to keep unchanged from here on, not from their issue
                    for *_, op, _ in self._ops:
                        if getattr(op, "is_wait", False):
                            break
                        resnap = getattr(op, "resnap", None)
                        if resnap is not None:
                            resnap()

                waited.is_wait = True  # type: ignore[attr-defined]
                self.enqueue(waited)
                return
        event.run_copies()  # an idle stream (compute: the worker thread) waits now


Span = tuple[int, int]  # (address, nbytes) of host memory


def _storage_span(t: torch.Tensor) -> Span:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


#: Copies whose host source changed while they were queued (see ``_copy_on``); any
#: entry fails the test that made it (``_no_source_races``).
FAKE_SOURCE_RACES: list[str] = []


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN): ``a`` unchanged since ``b`` was cloned from it."""

    def raw(t: torch.Tensor) -> torch.Tensor:  # a dense copy: views and expands have odd strides
        dense = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
        return dense.reshape(-1).view(torch.uint8)

    return torch.equal(raw(a), raw(b))


class _FakeCudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` that check what a GPU cannot: host
    memory is unregistered only after every copy reading or writing it has run (on a
    GPU, unregistering under an in-flight DMA is undefined behaviour, not an error)."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.ranges[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        size = self.ranges.pop(ptr, 0)
        for stream in _DRAINER.streams():
            if stream.pending_touch(ptr, size):
                raise AssertionError(
                    f"cudaHostUnregister({ptr:#x}, {size} bytes) while a copy touching that "
                    "memory is still queued on a stream: synchronize the device first"
                )
        return 0

    def cudaGetLastError(self) -> int:
        return 0


class _FakePinnedAllocator:
    """PyTorch's pinned host allocator as far as memory growth goes: every block is
    rounded up to a power of two, a freed block is kept for a later request of the
    same size and never given back. ``reserved`` is what stays page-locked; past
    ``cap`` an allocation fails, as the host's locked-memory limit would."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.reserved = 0
        self._lock = threading.Lock()
        self._free: collections.Counter[int] = collections.Counter()

    def alloc(self, nbytes: int) -> torch.Tensor:
        size = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            if self._free[size]:
                self._free[size] -= 1
            else:
                if self.reserved + size > self.cap:
                    raise RuntimeError(
                        f"fake pinned allocator: {size} more bytes would page-lock "
                        f"{self.reserved + size} bytes, over its cap of {self.cap}"
                    )
                self.reserved += size
        block = torch.full((nbytes,), 0xFF, dtype=torch.uint8)  # NaN / -1 until written
        weakref.finalize(block, self._give_back, size)
        return block

    def _give_back(self, size: int) -> None:
        with self._lock:
            self._free[size] += 1


#: Page-locked bytes the whole fake-CUDA run may hold (CUDA's allocator is per process).
FAKE_PINNED_CAP_BYTES = 64 * 1024**2
FAKE_PINNED = _FakePinnedAllocator(FAKE_PINNED_CAP_BYTES)


class _Drainer:
    """Runs the copies nobody waited for once they are ``FAKE_COPY_DELAY_S`` old."""

    def __init__(self) -> None:
        self._streams: weakref.WeakSet[_FakeStream] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, stream: _FakeStream) -> None:
        with self._lock:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="fake-cuda-drainer", daemon=True
                )
                self._thread.start()

    def streams(self) -> list[_FakeStream]:
        with self._lock:
            return list(self._streams)

    def _loop(self) -> None:
        while True:
            time.sleep(FAKE_COPY_DELAY_S / 5)
            cutoff = time.monotonic() - FAKE_COPY_DELAY_S
            for stream in self.streams():
                stream.run_due(cutoff)


_DRAINER = _Drainer()


#: Host waits on the GPU (``Event.synchronize``, ``torch.cuda.synchronize``) by thread
#: name: a worker thread that waits inside every microbatch leaves the GPU without
#: queued work; the tests bound these per microbatch.
FAKE_HOST_SYNCS: collections.Counter[str] = collections.Counter()


def worker_host_syncs() -> int:
    """Host waits made so far on CUDA worker threads (not their parameter feeders)."""
    return sum(
        n
        for name, n in FAKE_HOST_SYNCS.items()
        if name.startswith("roundpipe-cuda-") and name.split("-")[-1].isdigit()
    )


def _fake_synchronize(device: Any = None) -> None:
    FAKE_HOST_SYNCS[threading.current_thread().name] += 1
    for stream in _DRAINER.streams():
        stream.run_until(stream.mark())


class _FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False
        self.t = 0.0
        self._stream: _FakeStream | None = None
        self._seq = 0

    def record(self, stream: _FakeStream | None = None) -> None:
        self.recorded, self.t = True, time.perf_counter()
        self._stream = stream
        self._seq = stream.mark() if stream is not None else 0

    def synchronize(self) -> None:
        assert self.recorded, "synchronize() on an event that was never recorded"
        FAKE_HOST_SYNCS[threading.current_thread().name] += 1
        self.run_copies()

    def run_copies(self) -> None:
        """Run the copies this event waits for (a stream's wait: not a host sync)."""
        if self._stream is not None:
            self._stream.run_until(self._seq)

    def query(self) -> bool:
        return self.recorded and (self._stream is None or self._stream.done(self._seq))

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.t - self.t) * 1000.0


class _FakeDeviceMemory:
    """The fake GPU's memory: 16 GiB with 8 free and nothing counted, unless a test turns
    on a ``FakeCachingAllocator`` (the ``fake_device_memory`` fixture)."""

    allocator: FakeCachingAllocator | None = None

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        if self.allocator is None:
            return 8 << 30, 16 << 30
        return self.allocator.capacity - self.allocator.reserved, self.allocator.capacity

    def memory_reserved(self, device: Any = None) -> int:
        return 0 if self.allocator is None else self.allocator.reserved


FAKE_DEVICE_MEMORY = _FakeDeviceMemory()


@contextlib.contextmanager
def _current_stream(stream: Any) -> Any:
    """``torch.cuda.stream(s)``: allocations inside are made on ``s``."""
    before, CURRENT.stream = CURRENT.stream, stream
    try:
        yield
    finally:
        CURRENT.stream = before


@contextlib.contextmanager
def _with_modes(compute: Any, modes: list[Any]) -> Any:
    """A worker's ``compute()`` under the fake GPU's dispatch modes (its generator, its
    memory)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(compute)
        for mode in modes:
            stack.enter_context(mode)
        yield


class _FakeGpuRngSwitch:
    """Per-fake-GPU generators (``fake_gpu_rng`` fixture), off unless a test turns them on."""

    rng: FakeGpuRng | None = None


FAKE_GPU_RNG = _FakeGpuRngSwitch()


def _cpu_backed_worker_class() -> type:
    from roundpipe_core.running.devices.cuda import CUDAWorker

    class CPUBackedCUDAWorker(CUDAWorker):
        """CUDAWorker whose "device memory" is CPU memory: the CUDA calls are faked,
        the worker's own logic (feeder, chunking, tickets, events, ledger, RNG, locks)
        is real. Copies land late (see ``_FakeStream``) into buffers filled with NaN,
        so compute or a caller that skips a wait reads NaN. Tiny parameter chunks and a
        tiny download staging ring, so that every upload goes through several feeder
        units, most downloads through several staged pieces, and the ring comes round
        to pieces still in use within a call; the rings come from ``FAKE_PINNED``
        (power-of-two blocks, a cap)."""

        #: the tiny sizes below; a test of large tensors raises them (class attributes)
        fake_param_chunk_bytes = 96
        fake_download_staging_bytes = 512

        def __init__(self, index: int, device: torch.device, **kwargs: Any) -> None:
            kwargs = {
                "param_chunk_bytes": self.fake_param_chunk_bytes,
                "param_inflight_chunks": 2,
                "download_staging_bytes": self.fake_download_staging_bytes,
                **kwargs,
            }
            super().__init__(index, device, **kwargs)
            self._downloads.lazy_bytes = 1024  # a tiny lazy ring: it fills and drains
            # Model code sees where its tensors really are (layers that move
            # temporaries to ``device`` must find CPU memory there).
            self.device = torch.device("cpu")

        def _new_device_tensor(self, like: torch.Tensor) -> torch.Tensor:
            with host_side():  # counted below, on the stream current here
                out = _poisoned(like)
            allocator = FAKE_DEVICE_MEMORY.allocator
            if allocator is not None:
                allocator.track(out.untyped_storage(), CURRENT.stream)
            return out

        def _new_host_tensor(self, like: torch.Tensor) -> torch.Tensor:
            with host_side():
                return _poisoned(like)

        def _new_pinned_buffer(self, nbytes: int) -> torch.Tensor:
            with host_side():
                return FAKE_PINNED.alloc(nbytes)

        def compute(self) -> Any:
            allocator, rng = FAKE_DEVICE_MEMORY.allocator, FAKE_GPU_RNG.rng
            if allocator is None and rng is None:
                return super().compute()
            modes = [] if rng is None else [rng.mode(self.gpu_index)]
            if allocator is not None:
                modes.append(DeviceAllocations(allocator))
            return _with_modes(super().compute(), modes)

        @property
        def draws_from_host_generator(self) -> bool:  # type: ignore[override]
            # model code draws from the CPU generator unless per-GPU generators are on
            return FAKE_GPU_RNG.rng is None

        def get_rng_state(self) -> Any:
            rng = FAKE_GPU_RNG.rng
            return super().get_rng_state() if rng is None else rng.get_state(self.gpu_index)

        def set_rng_state(self, state: Any) -> None:
            rng = FAKE_GPU_RNG.rng
            if rng is None:
                super().set_rng_state(state)
            else:
                rng.set_state(self.gpu_index, state)

        def _copy_on(
            self, stream: _FakeStream, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
        ) -> None:
            with host_side():  # the snapshots are the fake's, not device memory
                self._enqueue_copies(stream, list(pairs))

        def _enqueue_copies(
            self, stream: _FakeStream, pairs: list[tuple[torch.Tensor, torch.Tensor]]
        ) -> None:
            # A GPU reads the host source when the DMA runs, not at issue: a source that
            # changes in between (a buffer written back, weights published) is a race.
            snapshots = [src.clone() for _, src in pairs]
            touches = [_storage_span(t) for pair in pairs for t in pair]
            if stream is self.download_stream:
                stream.enqueue(self._download_op(pairs, snapshots), touches)
                return

            def copy() -> None:
                with torch.no_grad(), host_side():  # the fake's checks allocate, not the GPU
                    for (dst, src), snap in zip(pairs, snapshots):
                        if not _same_bits(src, snap):
                            FAKE_SOURCE_RACES.append(
                                f"a {tuple(src.shape)} {src.dtype} copy source changed "
                                "between the copy's issue and its run"
                            )
                        dst.copy_(src)

            def resnap() -> None:
                with torch.no_grad(), host_side():
                    snapshots[:] = [src.clone() for _, src in pairs]

            copy.resnap = resnap  # type: ignore[attr-defined]
            stream.enqueue(copy, touches)

        @staticmethod
        def _download_op(
            pairs: list[tuple[torch.Tensor, torch.Tensor]], snapshots: list[torch.Tensor]
        ) -> Callable[[], None]:
            """A download, holding its device sources only weakly: on a GPU the caching
            allocator hands memory out again once nothing holds it, so a source freed
            before its DMA ran is a race too (stricter than CUDA, where
            ``record_stream`` on the download stream would also hold it: the worker
            keeps its sources referenced until the download is finished)."""
            sources = [
                (
                    StorageWeakRef(src.untyped_storage()),
                    src.storage_offset(),
                    src.shape,
                    src.stride(),
                    src.dtype,
                )
                for _, src in pairs
            ]
            dsts = [dst for dst, _ in pairs]
            del pairs

            def copy() -> None:
                with torch.no_grad(), host_side():
                    for dst, (ref, offset, shape, stride, dtype), snap in zip(
                        dsts, sources, snapshots
                    ):
                        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
                        if storage is None:
                            FAKE_SOURCE_RACES.append(
                                f"a {tuple(shape)} {dtype} download's device source was "
                                "freed before the download ran"
                            )
                            dst.copy_(snap)  # what it held: the test reports the race
                            continue
                        src = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
                        if not _same_bits(src, snap):
                            FAKE_SOURCE_RACES.append(
                                f"a {tuple(shape)} {dtype} download's device source changed "
                                "between the download's issue and its run"
                            )
                        dst.copy_(src)

            return copy

    return CPUBackedCUDAWorker


CPUBackedCUDAWorker = _cpu_backed_worker_class()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> type:
    """Pretend one GPU exists; CUDA workers become ``CPUBackedCUDAWorker`` (returned)."""
    from roundpipe_core.running.devices import cuda as cuda_mod
    from roundpipe_core.running.devices import memory

    c = torch.cuda
    # the pool sets the allocator's defaults before CUDA starts: undone after the test
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(c, "is_available", lambda: True)
    monkeypatch.setattr(c, "device_count", lambda: 1)
    monkeypatch.setattr(c, "Stream", _FakeStream)
    monkeypatch.setattr(c, "Event", _FakeEvent)
    monkeypatch.setattr(c, "stream", _current_stream)
    monkeypatch.setattr(c, "device", lambda d: nullcontext())
    monkeypatch.setattr(c, "set_device", lambda d: None)
    monkeypatch.setattr(c, "set_stream", lambda s: setattr(CURRENT, "stream", s))
    monkeypatch.setattr(c, "synchronize", _fake_synchronize)
    monkeypatch.setattr(c, "get_rng_state", lambda d=None: torch.get_rng_state())
    monkeypatch.setattr(c, "set_rng_state", lambda s, d=None: torch.set_rng_state(s))
    monkeypatch.setattr(c, "mem_get_info", FAKE_DEVICE_MEMORY.mem_get_info)
    monkeypatch.setattr(c, "memory_reserved", FAKE_DEVICE_MEMORY.memory_reserved)
    monkeypatch.setattr(cuda_mod, "CUDAWorker", CPUBackedCUDAWorker)
    # pin_model: "alloc" still packs the weights into slabs (of ordinary memory);
    # "register" registers with a fake runtime that refuses to unregister memory a
    # queued copy still touches.
    pack = memory.pack_module_tensors
    monkeypatch.setattr(
        memory,
        "pack_module_tensors",
        lambda tensors, pin, slab_bytes=memory.DEFAULT_SLAB_BYTES: pack(tensors, False, slab_bytes),
    )
    monkeypatch.setattr(c, "cudart", lambda: _FAKE_CUDART)
    return CPUBackedCUDAWorker


_FAKE_CUDART = _FakeCudart()


@pytest.fixture
def fake_device_memory(fake_cuda: type) -> Any:
    """``fake_device_memory(capacity_bytes)`` -> a ``FakeCachingAllocator`` that the fake GPU
    allocates from until the test ends: uploads and every new storage inside a worker's
    ``compute()``, per stream, ``torch.OutOfMemoryError`` past the capacity, which
    ``torch.cuda.mem_get_info`` then reports as the device's total memory."""

    def start(capacity: int, expandable: bool | None = None) -> FakeCachingAllocator:
        FAKE_DEVICE_MEMORY.allocator = FakeCachingAllocator(capacity, expandable)
        return FAKE_DEVICE_MEMORY.allocator

    yield start
    FAKE_DEVICE_MEMORY.allocator = None


@pytest.fixture
def fake_gpu_rng(fake_cuda: type, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``fake_gpu_rng(sm_counts)`` -> a ``FakeGpuRng``: ``len(sm_counts)`` fake GPUs, each
    with its own generator (seeded from its index) whose draws depend on its SM count;
    ``torch.cuda.get_device_properties(i)`` reports ``sm_counts[i]``."""

    def start(sm_counts: list[int]) -> FakeGpuRng:
        rng = FakeGpuRng(sm_counts)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(sm_counts))
        monkeypatch.setattr(torch.cuda, "get_device_properties", rng.props)
        FAKE_GPU_RNG.rng = rng
        return rng

    yield start
    FAKE_GPU_RNG.rng = None


@pytest.fixture
def fake_pinned() -> _FakePinnedAllocator:
    """The fake pinned allocator the fake-CUDA workers stage their downloads through
    (a fixture: ``from conftest import`` would find another directory's conftest)."""
    return FAKE_PINNED


@pytest.fixture
def host_syncs() -> Callable[[], int]:
    """``host_syncs()`` -> host waits made so far on fake-CUDA worker threads."""
    return worker_host_syncs


@pytest.fixture
def take_source_races() -> Callable[[], list[str]]:
    """``take_source_races()`` -> the fake-CUDA copy races reported so far, cleared (a
    test that provokes one on purpose takes it, so the autouse check stays quiet).
    A fixture, not ``from conftest import``: under the whole suite that name is
    another directory's conftest."""

    def take() -> list[str]:
        races, FAKE_SOURCE_RACES[:] = list(FAKE_SOURCE_RACES), []
        return races

    return take
