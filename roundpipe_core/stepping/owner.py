"""The one owner of a RoundPipe's optimizer side, :class:`StepOwner`: the optimizer
thread (``stepper``) with the overlapped iterations (``pipelined``), the weight versions
and the layer-wise step behind it. The model and the adapters call its verbs and nothing
else of the wing but the buffers, pending results and masters they hand around.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..planning.schedule import Job
from ..running.devices.pool import PoolError
from .layerwise import GradCompletion
from .pipelined import GradBuffer, PendingResult, PipelinedRuns

__all__ = ["PipelinedCall", "StepOwner"]


class PipelinedCall:
    """The optimizer side of one ``forward_backward(blocking=False)`` being issued
    (:meth:`StepOwner.pipelined_call`): where its schedule starts, the weight version
    its uploads read, and its :class:`PendingResult`."""

    def __init__(self, runs: PipelinedRuns, blocking: bool) -> None:
        self._runs = runs
        self._blocking = blocking
        # round-robin continues from a call still running (its last device is the last to
        # become free); with every device idle a call starts on the first, as a lone one
        running = any(not r.done() for r in runs.inflight())
        self.start_device = runs.next_device if running else 0
        self.weights = runs.versions  # what the call's uploads wait on, layer by layer
        self.reader: Any = None
        self.launched = False
        # the call's PendingResult, set by the caller before its jobs are submitted;
        # weakly, as that result holds this call's completion callback: a strong
        # reference would make every call a cycle that only the garbage collector frees
        self.pending_ref: Callable[[], PendingResult | None] = lambda: None

    def completion(
        self, jobs: Sequence[Job], masters_of: Callable[[Job], list[nn.Parameter]]
    ) -> GradCompletion:
        """Which masters' gradients are complete as the backward goes: completing ones
        wake the optimizer thread (a layer-wise step) and, with gradient hooks, are merged
        and reported (:meth:`PipelinedRuns.merge_completed`)."""
        return GradCompletion(
            jobs,
            masters_of,
            self._runs.versions.notify,
            self._merge_completed,
        )

    def _merge_completed(self, masters: list[nn.Parameter]) -> None:
        pending = self.pending_ref()
        if pending is not None:  # (else no longer in flight: merged, nothing to do)
            self._runs.merge_completed(pending, masters)

    def reserve(self, job_layers: Sequence[range], num_devices: int) -> Any:
        """The call's jobs are known: the next call starts on the device after its last;
        returns the reader of the current target version its uploads register with (for a
        blocking call while a plain step's weights are still being copied into the model,
        gated by that copy: ``versions._Reader``)."""
        runs = self._runs
        runs.next_device = (runs.next_device + len(job_layers)) % num_devices
        publication = runs.last_publication()
        gate = None
        if self._blocking and publication is not None and not publication.done():
            gate = (publication, lambda: runs.failure is not None)
        self.reader = runs.versions.register(runs.target_version, job_layers, gate)
        return self.reader

    def launch(self, pending: PendingResult) -> None:
        """The call's jobs were submitted: it is in flight from now on."""
        self._runs.add(pending)
        self.launched = True
        # A failure recorded since this call's raise_failure() aborted the calls in flight
        # before this one was among them: abort it too, or its uploads would wait for a
        # weight version the failed step never publishes
        if self._runs.failure is not None:
            pending.run.fail(PoolError("an earlier pipelined iteration or step failed"))


class StepOwner(PipelinedRuns):
    """A RoundPipe's optimizer side (see the module docstring; arguments as
    :class:`PipelinedRuns`)."""

    # -- steps --------------------------------------------------------------------------
    def step(
        self,
        fn: Callable[[], Any],
        is_async: bool,
        may_publish_in_background: bool,
        settle: Callable[[], None],
    ) -> None:
        """Queue ``fn`` (the user's step) on the optimizer thread: deferred until the
        gradients of the iterations in flight are complete. After blocking calls the copy
        of the previous step's weights into the model runs on the thread ahead of it when
        ``may_publish_in_background`` and the step before left nothing to report; else
        now. ``is_async=False`` returns once it is done. ``settle``: how the caller
        settles (:meth:`settle` and what a wrapper keeps outside the masters).
        """
        self.raise_failure()
        if self.inflight():
            self.defer_step(fn)  # its error is raised through raise_failure()
        else:
            # the step before is a plain one that has not failed already (that error is
            # raised by this step(), as always)
            pending = self.pending()
            lets_publish = pending is None or not (
                self.pending_is_guarded() or (pending.done() and pending.exception() is not None)
            )
            if is_async and may_publish_in_background and lets_publish:
                self.masters.take_back_grads()  # the copy into the model: on the thread
            else:
                settle()  # the copy now (and the previous step's error raised)
            self.queue_publish_then_step(fn)  # its error is raised by settle()
        if not is_async:
            settle()

    def step_layerwise(
        self,
        step_params: Callable[[list[nn.Parameter]], Any],
        finish: Callable[[], Any] | None,
        is_async: bool,
        may_publish_in_background: bool,
        wrap: Callable[[Callable[[], None]], Callable[[], None]],
        settle: Callable[[], None],
    ) -> None:
        """``RoundPipeBase.step_layerwise``; ``wrap`` wraps the work item (the step
        recorder)."""
        self.raise_failure()
        if not self.inflight():
            masters = self.masters.params()

            def whole() -> None:
                step_params(masters)
                if finish is not None:
                    finish()

            self.step(wrap(whole), is_async, may_publish_in_background, settle)
            return
        self.defer_layerwise_step(step_params, finish, wrap)
        if not is_async:
            settle()

    # -- waiting ------------------------------------------------------------------------
    def drain(self) -> None:
        """Before a ``forward()``: wait for the iterations in flight and the weights the
        model should hold now; raise an earlier failure."""
        self.wait_all()
        self.wait_publication()
        self.raise_failure()

    def settle(self) -> None:
        """Wait for everything in flight -- iterations and steps -- raising the first
        error; merge finished iterations not followed by a step; the masters are then
        the model's weights."""
        self.raise_failure()
        self.wait_idle()
        self.raise_failure()
        for r in self.inflight():  # all finished: merged in issue order
            self.merge(r)
        fut = self.take_pending()
        if fut is not None:
            fut.result()
            self.publish_all()
        # work queued behind the step (in_step_order, gradient merges) ran in wait_idle()
        self.wait_after()

    # -- gradients ----------------------------------------------------------------------
    def fold(self, buffer: GradBuffer) -> None:
        """Add a ``forward()``'s backward's gradients to ``.grad`` once the step in flight
        (which reads and clears them) and the work queued behind it ran."""
        self.wait_step()
        self.wait_after()
        self.masters.add_many(buffer.take())

    def in_step_order(self, fn: Callable[[], Any], settle: Callable[[], None]) -> None:
        """Run ``fn`` (e.g. ``zero_grad``) in program order with the steps: after the step
        in flight (:meth:`after_step`); with overlapped iterations in flight, whose
        gradients enter ``.grad`` only before the next step, ``settle()`` first."""
        if self.inflight():
            settle()
            fn()
            return
        self.after_step(fn)

    # -- calls --------------------------------------------------------------------------
    @contextmanager
    def pipelined_call(self, blocking: bool) -> Iterator[PipelinedCall]:
        """Around issuing a ``forward_backward`` (after :meth:`raise_failure`): a call
        that is not launched releases what it reserved."""
        if not blocking:
            # a plain step in flight: its error must stop this call and the next ones
            # (the failure path); a blocking call reads the last good weights instead,
            # and the next step() raises it
            self.guard_pending()
        call = PipelinedCall(self, blocking)
        try:
            yield call
        finally:
            if not call.launched and call.reader is not None:
                self.versions.finish(call.reader)

    def call_ended(self, pending: PendingResult) -> None:
        """A pipelined call's jobs are all done (its last worker's thread): release what
        its uploads read, and report its error to the failure path (the failure itself
        where one aborted the call)."""
        self.versions.finish(pending.run.reader)
        if pending.error is not None:
            failure = self.failure
            if isinstance(pending.error, PoolError) and failure is not None:
                pending.error = failure
            self.record_failure(pending.error)
