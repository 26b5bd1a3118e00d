"""The optimizer thread of a RoundPipe: queued steps, their order, their failures.

``step()`` hands the user's ``step_fn`` to one dedicated thread, so the update of the
masters overlaps the next pipelined call; work queued there (a weight publication, the
merge of pipelined gradients, a step) runs in submission order. Two kinds of work:

* a **plain step** (after blocking calls): its error stays in its future and is raised
  by the next ``synchronize()`` (which ``step()`` and ``close()`` call).
* **guarded work** (the pipelined path: deferred steps, weight publications): an error
  becomes the stepper's *failure*; everything queued after it is skipped,
  ``on_failure`` aborts the iterations in flight, and the error is raised exactly once,
  by the next call.

One lock, ``Stepper._lock``, guards every mutable field; it is held only to read or
assign them and to queue work -- never while waiting on a future, running queued work
or calling ``on_failure`` -- so it cannot take part in a lock-order cycle.

The thread is a daemon whose target references only the queue, so a RoundPipe dropped
without ``close()`` can be garbage-collected; exit: docs/failure-semantics.md.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..running.host_memory import note_training_step

__all__ = ["ClosedError", "Stepper"]

_Item = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class ClosedError(RuntimeError):
    """Work was given to a RoundPipe after ``close()``."""


def _serve(work: queue.SimpleQueue[_Item | None], intra_op_threads: int | None = None) -> None:
    # A plain function over the queue only: the thread references nothing else, so
    # it keeps no RoundPipe alive between items.
    if intra_op_threads is not None:
        # before the first step: the steps' CPU kernels leave cores to the GPU workers
        torch.set_num_threads(intra_op_threads)
    while True:
        item = work.get()
        if item is None:
            return
        fut, fn, args = item
        del item
        if fut.set_running_or_notify_cancel():
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
                fut.set_exception(exc)
            else:
                fut.set_result(result)
                del result
        del fut, fn, args


#: seconds interpreter exit waits for an optimizer thread's queued work (env override)
EXIT_WAIT_ENV = "ROUNDPIPE_EXIT_WAIT_S"
_DEFAULT_EXIT_WAIT_S = 60.0

# the exit hook's view (weak): the optimizer threads to stop, and the threads to wait
# for -- a running thread stays in the second even after its RoundPipe was dropped
_LIVE_OPTIMIZERS: weakref.WeakSet[Stepper] = weakref.WeakSet()
_RUNNING_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def exit_wait_s() -> float:
    """How long interpreter exit waits for each optimizer thread (``$ROUNDPIPE_EXIT_WAIT_S``)."""
    raw = os.environ.get(EXIT_WAIT_ENV, "").strip()
    try:
        value = float(raw) if raw else _DEFAULT_EXIT_WAIT_S
    except ValueError:
        value = -1.0
    if value >= 0:
        return value
    warnings.warn(
        f"${EXIT_WAIT_ENV}={raw!r} is not a number of seconds >= 0; using {_DEFAULT_EXIT_WAIT_S:g}",
        RuntimeWarning,
        stacklevel=2,
    )
    return _DEFAULT_EXIT_WAIT_S


def _finish_at_exit() -> None:
    """At interpreter exit, let each optimizer thread finish what is queued (up to
    ``exit_wait_s()`` each; warns about work it drops): a daemon thread still inside a
    torch kernel when the interpreter finalizes aborts the process (SIGABRT)."""
    bound = exit_wait_s()
    for worker in list(_LIVE_OPTIMIZERS):
        worker.shutdown(timeout=0.0)  # the thread ends after what is queued
    for thread in list(_RUNNING_THREADS):
        if thread is not threading.current_thread():
            thread.join(bound)
        if thread.is_alive():
            warnings.warn(
                f"{thread.name}: an optimizer step was still running {bound:g} s after the "
                f"interpreter began to exit; it is dropped (${EXIT_WAIT_ENV} sets the wait; "
                "call synchronize() or close() before exiting to finish it)",
                RuntimeWarning,
                stacklevel=1,
            )


atexit.register(_finish_at_exit)


class Stepper:
    """The optimizer thread of one RoundPipe: a daemon thread running queued callables in
    order, each into a ``Future``, with the pending step and the failure state.

    Args:
        name: the RoundPipe's name (names the thread).
        intra_op_threads: ``torch.set_num_threads`` for the thread's work (None: the
            default); the pool decides (``DevicePool.optimizer_threads``).
    """

    def __init__(self, name: str, intra_op_threads: int | None = None) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(
            target=_serve,
            args=(self._queue, intra_op_threads),
            name=f"roundpipe-optim-{name}",
            daemon=True,
        )
        self._thread.start()
        _LIVE_OPTIMIZERS.add(self)
        _RUNNING_THREADS.add(self._thread)
        self._lock = threading.RLock()
        self._pending: Future | None = None  # the last step queued
        self._pending_guarded = False  # whether its error goes to the failure state
        self._tail: Future | None = None  # the last work queued
        self._publish: Future | None = None  # the last weight publication queued
        self._failure: BaseException | None = None  # first failure of guarded work
        self._reported = False  # the failure has been raised to the user
        self._steps = 0  # steps queued so far: step k produces weight version k
        # work queued by after_step() whose errors the caller still has to see
        self._after: list[Future] = []
        # aborts the pipelined iterations in flight when guarded work fails
        self.on_failure: Callable[[], None] | None = None

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; ClosedError after ``shutdown()``."""
        fut: Future = Future()
        with self._lock:
            self.check_open()
            self._queue.put((fut, fn, args))
        return fut

    # -- state -----------------------------------------------------------------------
    @property
    def steps(self) -> int:
        with self._lock:
            return self._steps

    @property
    def failure(self) -> BaseException | None:
        with self._lock:
            return self._failure

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> Future | None:
        with self._lock:
            return self._pending

    def pending_is_guarded(self) -> bool:
        """Whether the pending step's error goes to the failure state (see the module)."""
        with self._lock:
            return self._pending is not None and self._pending_guarded

    def tail(self) -> Future | None:
        with self._lock:
            return self._tail

    def last_publication(self) -> Future | None:
        with self._lock:
            return self._publish

    # -- queueing ----------------------------------------------------------------------
    def queue(
        self, fn: Callable[[], Any], guarded: bool, step: bool = True, publishes: bool = False
    ) -> None:
        """Queue ``fn``: guarded work (the pipelined path) or a plain step, whose error is
        raised by the next ``take_pending().result()``. ``step``: it is a step (the
        pending one; step k produces weight version k); ``publishes``: it writes a step's
        weights into the model."""
        with self._lock:
            fut = self._submit(self._run_guarded, fn) if guarded else self._submit(fn)
            self._tail = fut
            if publishes:
                self._publish = fut
            if step:
                self._pending, self._pending_guarded = fut, guarded
                self._steps += 1
        if step:
            note_training_step()  # the host-memory budget's training-code line

    def guard_pending(self) -> None:
        """Route the error of a plain step still in flight to the failure state: a
        pipelined call is issued after it, and only guarded errors reach that path."""
        with self._lock:
            fut = self._pending
            if fut is None or self._pending_guarded:
                return
            self._pending = self._tail = self._submit(self._run_guarded, fut.result)
            self._pending_guarded = True

    def after_step(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once the pending step has run: at once when none is in flight, else
        on the optimizer thread right after it (a worker that downloaded gradients hands
        their merge into ``.grad``, which the step reads and clears, here: a device never
        waits for a step). Errors are raised by ``wait_after()``."""
        with self._lock:
            pending = self._pending
            if pending is not None and not pending.done():
                self._tail = fut = self._submit(fn)
                self._after.append(fut)
                return
        fn()

    def wait_after(self) -> None:
        """Block until the work ``after_step()`` queued has run; raise its first error."""
        with self._lock:
            queued, self._after = self._after, []
        errors = [e for e in (f.exception() for f in queued) if e is not None]
        if errors:
            raise errors[0]

    def _run_guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.failure is not None:
            return  # an earlier failure: everything queued after it is skipped
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - raised to the user by the next call
            self.record_failure(exc)

    # -- failures ----------------------------------------------------------------------
    def record_failure(self, exc: BaseException) -> None:
        """Keep the first failure of the pipelined path and abort the work in flight."""
        with self._lock:
            if self._failure is None:
                self._failure = exc
                self._reported = False
        callback = self.on_failure
        if callback is not None:
            callback()

    def mark_reported(self, exc: BaseException) -> None:
        """``exc`` has been raised to the user (by a ``PendingResult``)."""
        with self._lock:
            if self._failure is exc:
                self._reported = True

    def reset_after_failure(self) -> BaseException | None:
        """Forget the failure and everything queued; return it unless already raised."""
        with self._lock:
            exc, reported = self._failure, self._reported
            self._failure = None
            self._pending = self._tail = self._publish = None
        return None if reported else exc

    def take_pending(self) -> Future | None:
        """The pending step (to wait on and raise from); the stepper forgets it."""
        with self._lock:
            fut = self._pending
            self._pending = self._tail = self._publish = None
        return fut

    # -- waiting (an error is not raised here) -------------------------------------------
    def wait_step(self) -> None:
        """Block until the pending step has run (its error is raised by ``synchronize()``)."""
        _wait(self.pending())

    def wait_tail(self) -> None:
        """Block until everything queued so far has run."""
        _wait(self.tail())

    def wait_publication(self) -> None:
        _wait(self.last_publication())

    # -- end -------------------------------------------------------------------------
    def unobserved_error(self) -> BaseException | None:
        """An error of queued work that finished and was never raised to the user."""
        with self._lock:
            if self._failure is not None and not self._reported:
                return self._failure
            fut = self._pending
        if fut is not None and fut.done() and not fut.cancelled():
            return fut.exception()
        return None

    def on_optimizer_thread(self) -> bool:
        """Whether the caller runs on the optimizer thread (inside a step)."""
        return threading.current_thread() is self._thread

    def check_open(self) -> None:
        """Raises ClosedError after ``shutdown()``."""
        if self._closed:
            raise ClosedError(
                f"this RoundPipe ({self.name!r}) is closed; create a new one to keep training"
            )

    def shutdown(self, timeout: float | None = 0.0) -> None:
        """Stop taking work; the thread ends after what is queued. Waits up to ``timeout``
        seconds for that (``None``: until it has ended)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        if not self.on_optimizer_thread() and (timeout is None or timeout > 0):
            self._thread.join(timeout)


def _wait(fut: Future | None) -> None:
    if fut is not None:
        fut.exception()
