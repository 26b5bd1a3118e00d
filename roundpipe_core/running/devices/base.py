"""The worker interface: one thread per compute device, plus transfer primitives.

The scheduler, transfer engine and runtime talk to devices only through it, so the CPU
backend runs exactly the code the CUDA backend runs: a backend implements the
``abstractmethod`` primitives; the thread and its job queue are shared.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from operator import attrgetter
from typing import Any

import torch

__all__ = ["MemoryLedger", "Worker", "WorkerStartError"]

NBYTES = attrgetter("nbytes")  # sum(map(NBYTES, ts)): a C-level pass, called per job


class MemoryLedger:
    """Bytes a device holds, by tag ("param", "grad", "activation"), with the peak
    (thread-safe): tests assert the memory bound with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def alloc(self, nbytes: int, tag: str) -> None:
        """Count ``nbytes`` more under ``tag`` (a batch of copies at once: its peak is the
        peak within it)."""
        with self._lock:
            now = self.current.get(tag, 0) + nbytes
            self.current[tag] = now
            if now > self.peak.get(tag, 0):
                self.peak[tag] = now

    def free(self, nbytes: int, tag: str) -> None:
        with self._lock:
            self.current[tag] = self.current.get(tag, 0) - nbytes


_STOP = object()


class WorkerStartError(RuntimeError):
    """A worker's thread failed to set itself up; every job given to it fails with this."""


class Worker(ABC):
    """A compute device driven by one controller thread, which runs the callables
    ``submit`` is given in order (a ``Future`` each, so failures reach the caller)."""

    kind = "abstract"
    #: Whether model code on this worker draws from the host's (CPU) generator, so that
    #: replaying the worker's generator state replays a layer's CPU draws too.
    draws_from_host_generator = True
    #: ``time_point()`` returns seconds of one host clock, so ``elapsed_ms(a, b)`` is
    #: ``(b - a) * 1000`` and the runtime may compute it without a call per mark.
    time_points_are_seconds = False
    #: ``lend_in`` hands the host's parameters over as they are (device memory is host
    #: memory): a stage copies only its buffers and carried state.
    lends_host_tensors = False
    #: ``copy_in`` accepts host tensors a CUDA worker's ``copy_out_deferred`` has not
    #: filled yet (ordering its copy after that download); others get them completed.
    reads_pending_downloads = False

    def __init__(self, index: int, device: torch.device) -> None:
        self.index = index
        self.device = device
        self.ledger = MemoryLedger()
        # parameter-less copies of layers, reused across uploads (see transfer.py)
        self.skeletons: dict[tuple[int, int], Any] = {}
        # per stage (layers and skeleton slot): what each of its uploads does (transfer.py)
        self.stage_layouts: dict[tuple, Any] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._loop, name=f"roundpipe-{self.kind}-{index}", daemon=True
        )
        self._closed = False
        #: After ``close()``: whether the thread ended and the device finished every copy
        #: (only then may host memory those copies read be unregistered).
        self.drained = False
        self._start_error: BaseException | None = None
        self._started = threading.Event()
        self._thread.start()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.index}, {self.device})"

    def is_current(self) -> bool:
        """Whether the caller runs on this worker's thread (inside one of its jobs)."""
        return threading.current_thread() is self._thread

    # -- thread -------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._thread_init()
        except BaseException as exc:  # noqa: BLE001 - handed to every job, below
            self._start_error = exc
        self._started.set()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args, fut = item
            # Drop the queue's reference at once: from here on only these locals hold the job.
            item = None
            if fut.set_running_or_notify_cancel():
                if self._start_error is not None:
                    fut.set_exception(self._start_failure())
                else:
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)
            # This frame lives as long as the worker: an idle worker must not keep the
            # last job alive (its callable may be a bound method of the model, its
            # arguments hold tensors, a failed job's traceback holds its frames).
            fn = args = fut = None

    def _start_failure(self) -> WorkerStartError:
        """A fresh error per caller (one object raised in several threads would collect
        all their tracebacks)."""
        cause = self._start_error
        err = WorkerStartError(
            f"{self!r} could not start its thread: {type(cause).__name__}: {cause}; "
            "no job can run on it (close this RoundPipe and create a new one)"
        )
        err.__cause__ = cause
        return err

    def wait_started(self, timeout: float = 60.0) -> None:
        """Block until the worker's thread has set itself up (``WorkerStartError`` if the
        set-up raised, ``TimeoutError`` after ``timeout`` seconds)."""
        if not self._started.wait(timeout):
            raise TimeoutError(f"{self!r} did not start its thread within {timeout} s")
        if self._start_error is not None:
            raise self._start_failure()

    def _thread_init(self) -> None:  # noqa: B027 - optional hook
        """Per-thread set-up (e.g. selecting the CUDA device)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on this worker's thread after the jobs already queued; a
        ``Future`` of its result or exception (``RuntimeError`` on a closed worker,
        ``WorkerStartError`` if its thread failed to start)."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._start_error is not None:
            raise self._start_failure()
        fut: Future = Future()
        self._queue.put((fn, args, fut))
        return fut

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the jobs already queued (waits up to ``timeout`` s);
        ``drained`` then says whether it ended within that time."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            self.drained = not self._thread.is_alive()

    # -- transfers ----------------------------------------------------------
    @abstractmethod
    def copy_in(self, tensors: Sequence[torch.Tensor], channel: str) -> list[torch.Tensor]:
        """Host -> device copies. ``channel`` is "param" (prefetchable, low priority) or
        "activation" (the running stage waits on it). The copies are safe to use by
        compute issued after ``wait_channel(channel)``."""

    def wait_channel(self, channel: str) -> None:  # noqa: B027 - synchronous copies need nothing
        """Make subsequent compute wait for every copy issued so far on ``channel``."""

    @abstractmethod
    def copy_out(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device -> host copies, complete when this returns (ordered after compute so far)."""

    def lend_in(
        self, tensors: Sequence[torch.Tensor], read_only: Sequence[bool]
    ) -> list[torch.Tensor]:
        """Host -> device for a stage's parameters and buffers that nothing writes while it
        runs (``read_only[i]``: the stage only reads tensor ``i``). A backend whose memory
        is the host's hands those over as detached aliases and copies the rest; the ledger
        counts every tensor as a copy, as on every backend. Others copy all."""
        return self.copy_in(tensors, "param")

    def copy_out_deferred(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device -> host for tensors handed to another stage: an asynchronous backend's
        host tensors are filled when read (by an upload, ``downloads.complete_pending``,
        at the latest ``finish_lazy_downloads``), without a wait for each."""
        return self.copy_out(tensors)

    def copy_out_lazy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device -> host for small tensors read only after the queue (a loss): complete
        after ``finish_lazy_downloads``."""
        return self.copy_out(tensors)

    def finish_lazy_downloads(self) -> None:  # noqa: B027 - optional hook
        """Complete every ``copy_out_lazy`` and ``copy_out_deferred`` so far (the pool
        calls it when a queue ends, so a call's results are complete when it returns)."""

    def take_out(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device -> host for tensors the device drops right after (parameter gradients),
        complete when this returns."""
        return self.copy_out(tensors)

    def pinned_download_bytes(self) -> int:
        """Page-locked host bytes this worker's downloads hold (the budget's line)."""
        return 0

    def param_fence(self) -> Callable[[], None]:
        """A function that blocks until every "param" upload issued so far has read its
        host source (which may then be overwritten)."""
        return _noop

    def release(self, tensors: Sequence[torch.Tensor], tag: str) -> None:
        """Forget device tensors (ledger bookkeeping; CUDA keeps them alive until their streams are done)."""
        self.ledger.free(sum(map(NBYTES, tensors)), tag)

    # -- compute ------------------------------------------------------------
    @abstractmethod
    def compute(self) -> contextlib.AbstractContextManager:
        """Context in which this worker runs model code."""

    @abstractmethod
    def get_rng_state(self) -> Any:
        """RNG state that model code running on this worker draws from."""

    @abstractmethod
    def set_rng_state(self, state: Any) -> None: ...

    @abstractmethod
    def time_point(self) -> Any:
        """A marker in this worker's compute timeline."""

    @abstractmethod
    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two markers (may synchronise)."""

    @abstractmethod
    def memory_capacity(self) -> int:
        """Bytes of memory this device offers (for the planner's default memory limit)."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook; synchronous backends need nothing
        """Wait until all work issued on this device is done."""


def _noop() -> None:
    return None
