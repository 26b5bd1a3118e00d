"""Overlapping consecutive training iterations (``forward_backward(blocking=False)``);
see docs/architecture.md#overlapped-iterations for the weight versions (``versions.py``).

Iteration k+1's gradients wait in its own :class:`GradBuffer` and enter the masters'
``.grad`` after step k, before step k+1 (or at the run's ``result()``) -- the order a
blocking loop accumulates in. :class:`PipelinedRuns` merges them in issue order, defers
a step until the gradients it consumes are complete and turns a failure into one error
raised by the next call; :class:`PendingResult` is a non-blocking call's handle.

Lock order: ``_merge_lock`` before ``_runs_lock``; the stepper's and the masters' locks
are innermost. No lock here is held while waiting for an iteration or a queued step.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from .. import batch as batching
from ..config import RoundPipeRunConfig
from ..running.devices.pool import PoolError
from ..running.runtime import PipelineRun
from ..running.timer import CallTiming
from .layerwise import GradCompletion, run_layerwise
from .masters import MasterWeights
from .stepper import Stepper
from .versions import WeightVersions

__all__ = [
    "GradBuffer",
    "PendingResult",
    "PipelinedRuns",
    "RunFinisher",
]


class GradBuffer:
    """One pipelined run's gradients, summed per master until they may enter ``.grad``.

    A gradient is kept in the dtype it was downloaded in (bf16 from a bf16 model) and
    converted where the buffer is merged (:meth:`MasterWeights.add_many`), not on the
    worker, which should go on feeding its GPU; until then the host holds half the bytes.
    ``convert_on_add=True`` (CPU workers) converts a master's first gradient on arrival;
    a later one is added to it in one mixed-dtype ``add_``, so no converted copy of a
    whole job's gradients exists beside the bf16 ones.
    """

    def __init__(self, master_of: dict[int, nn.Parameter], convert_on_add: bool = False) -> None:
        self._master_of = master_of
        self._convert_on_add = convert_on_add
        self._lock = threading.Lock()
        self._grads: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """The run's grad sink: ``(host param, downloaded grad)``."""
        master = self._master_of.get(id(param))
        if master is None:
            return
        grad = self._arriving(master, grad)
        with self._lock:
            self._put(master, grad)

    def _arriving(self, master: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """``convert_on_add``: a master's first gradient is converted here, off the lock.
        The peek without the lock only decides where: :meth:`_put` sums either form."""
        if self._convert_on_add and grad.dtype != master.dtype and id(master) not in self._grads:
            return grad.to(master.dtype)
        return grad

    def _put(self, master: nn.Parameter, grad: torch.Tensor) -> None:
        """Keep ``grad`` for ``master`` (the lock is held); a second one (a shared
        parameter, a stage's next replica) is summed in the master's dtype."""
        hit = self._grads.get(id(master))
        if hit is None:
            if self._convert_on_add and grad.dtype != master.dtype:
                grad = grad.to(master.dtype)  # (taken since :meth:`_arriving` peeked)
            self._grads[id(master)] = (master, grad)
        elif hit[1].dtype == master.dtype:
            hit[1].add_(grad)
        else:
            self._grads[id(master)] = (master, hit[1].to(master.dtype).add_(grad))

    def add_many(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """:meth:`add` for one job's gradients under one lock acquisition (each through
        ``add`` where it was replaced: a subclass, a test's probe)."""
        if type(self).add is not GradBuffer._plain_add:
            for param, grad in zip(params, grads):
                self.add(param, grad)
            return
        pairs = [
            (master, self._arriving(master, grad))
            for param, grad in zip(params, grads)
            if (master := self._master_of.get(id(param))) is not None
        ]
        with self._lock:
            for master, grad in pairs:
                self._put(master, grad)

    _plain_add = add  # the add that add_many stands for

    def take(
        self, masters: Sequence[nn.Parameter] | None = None
    ) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The buffered ``(master, grad)`` pairs (of ``masters`` only, if given); they
        leave the buffer."""
        with self._lock:
            if masters is None:
                items, self._grads = list(self._grads.values()), {}
                return items
            return [hit for m in masters if (hit := self._grads.pop(id(m), None)) is not None]


def to_output_device(value: Any, device: Any) -> Any:
    """``value``'s tensors on ``device`` (CPU outputs stay where they are)."""
    if device is None or torch.device(device).type == "cpu":
        return value
    leaves, rebuild = batching.flatten(value)
    return rebuild([x.to(device) if isinstance(x, torch.Tensor) else x for x in leaves])


class PendingResult:
    """The handle of a ``forward_backward(..., blocking=False)`` call.

    ``result()`` waits for the iteration, puts its gradients into the masters' ``.grad``
    (after the step issued before the call consumed the previous ones) and returns what
    the blocking call would have. A failure of the iteration (or of an earlier one that
    aborted it) is raised there.
    """

    def __init__(
        self,
        runs: PipelinedRuns,
        run: PipelineRun,
        buffer: GradBuffer,
        cfg: RoundPipeRunConfig,
        num_microbatch: int,
        return_outputs: bool,
        completion: GradCompletion | None,
    ) -> None:
        self._runs = runs
        self.index = runs.calls  # pipelined calls of this RoundPipe, counted from 0
        self.run = run
        self.buffer = buffer
        self.cfg = cfg
        self.num_microbatch = num_microbatch
        self.return_outputs = return_outputs
        # the step that consumes the gradients issued before these
        self.prev_step: Future | None = runs.tail()
        self._futures: list[Future] = []
        self._finish: Callable[[PendingResult], Any] | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._left = 0
        self.error: BaseException | None = None
        self.merged = False
        self.reported: set[int] = set()  # masters the gradient hooks heard of (by id)
        # which masters' gradients are complete while the run is still going
        self.completion = completion

    @property
    def timing(self) -> CallTiming:
        """What the call measured (complete once the call is done)."""
        return self.run.timing

    def start(self, futures: list[Future], finish: Callable[[PendingResult], Any]) -> None:
        """Track the workers' futures; ``finish(self)`` runs once all are done."""
        self._futures, self._finish, self._left = futures, finish, len(futures)
        if not futures:
            self._complete()
        for f in futures:
            f.add_done_callback(self._worker_done)

    def _worker_done(self, _: Future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        errors = [f.exception() for f in self._futures if f.exception() is not None]
        if errors:
            primary = [e for e in errors if not isinstance(e, PoolError)]
            self.error = (primary or errors)[0]
        try:
            if self._finish is not None:
                self._finish(self)
        finally:
            # the workers' futures and the finish callback are not needed any more
            self._futures, self._finish = [], None
            self._done.set()

    def done(self) -> bool:
        """True once every job of the iteration has finished (or it failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the iteration's jobs (not for its gradients to reach ``.grad``)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"pipelined iteration {self.index} not done after {timeout} s")

    def result(self, timeout: float | None = None) -> Any:
        """The loss (or ``(loss, outputs)``) of the call; raises its error if it failed."""
        self.wait(timeout)
        return self._runs.result_of(self)

    def assembled(self) -> Any:
        """What ``forward_backward`` returns from the finished run's per-microbatch losses
        (summed; a loss_fn returning several losses gives one sum each) and outputs."""
        run, n = self.run, self.num_microbatch
        losses = [run.losses[i] for i in range(n)]
        if isinstance(losses[0], (tuple, list)):
            loss = type(losses[0])(torch.stack(parts).sum() for parts in zip(*losses))
        else:
            loss = torch.stack(losses).sum()
        if not self.return_outputs:
            return loss
        merged = batching.merge_outputs(self.cfg.merge_output, [run.outputs[i] for i in range(n)])
        return loss, to_output_device(merged, self.cfg.output_device)


class PipelinedRuns(Stepper):
    """The optimizer thread with the overlapped iterations of one RoundPipe: weight
    versions, the runs in flight, the merge of their gradients and the steps deferred
    behind them (``name``, ``layers`` and ``masters``: the RoundPipe's).

    Args:
        intra_op_threads: the optimizer thread's intra-op threads (None: the default).
        grad_hooks: told of each master whose gradient of a call entered ``.grad``.
    """

    def __init__(
        self,
        name: str,
        layers: list[nn.Module],
        masters: MasterWeights,
        intra_op_threads: int | None = None,
        grad_hooks: list[Callable[[list[nn.Parameter]], None]] | None = None,
    ) -> None:
        super().__init__(name, intra_op_threads)
        self.masters = masters
        self.grad_hooks = grad_hooks if grad_hooks is not None else []
        self.versions = WeightVersions(
            layers, masters.entries, masters.released, masters.publishers
        )
        self._runs_lock = threading.Lock()  # guards the fields below
        self._merge_lock = threading.Lock()  # one merge at a time; taken before _runs_lock
        self._inflight: list[PendingResult] = []  # runs whose grads are not in .grad yet
        self.target_version = 0  # the weight version a call issued now computes with
        self.next_device = 0  # round-robin continues from one pipelined call to the next
        self.calls = 0
        self.on_failure = self.abort_all

    def inflight(self) -> list[PendingResult]:
        with self._runs_lock:
            return list(self._inflight)

    def add(self, pending: PendingResult) -> None:
        with self._runs_lock:
            self._inflight.append(pending)
            self.calls += 1

    def abort_all(self) -> None:
        """Stop every run in flight (a step or an earlier iteration failed)."""
        for r in self.inflight():
            r.run.fail(PoolError("an earlier pipelined iteration or step failed"))

    def merge(self, r: PendingResult, only: Sequence[nn.Parameter] | None = None) -> None:
        """Add a finished run's gradients to ``.grad`` (once); with ``only``, those masters'
        only (a layer-wise step), the run staying unmerged. Taking and adding happen under
        one lock and ``merged`` turns True after: a step that finds the run merged, or a
        gradient gone from the buffer, finds it in ``.grad``."""
        with self._merge_lock:
            if r.merged:
                return
            self.masters.add_many(r.buffer.take(only))
            self._report(r, only)
            if only is not None:
                return
            r.merged = True
            with self._runs_lock:
                if r in self._inflight:
                    self._inflight.remove(r)

    def _report(self, r: PendingResult, only: Sequence[nn.Parameter] | None) -> None:
        """Tell the gradient hooks of the masters of ``r`` just merged into ``.grad``
        (each once per call; the merge lock is held, so in merge order)."""
        if not self.grad_hooks or r.completion is None:
            return
        candidates = r.completion.masters.values() if only is None else only
        fresh = [m for m in candidates if id(m) not in r.reported]
        if not fresh:
            return
        r.reported.update(id(m) for m in fresh)
        for hook in list(self.grad_hooks):
            hook(fresh)

    def merge_completed(self, r: PendingResult, masters: list[nn.Parameter]) -> None:
        """With gradient hooks, merge and report masters of ``r`` complete while it still
        runs (after the step in flight), so a data-parallel reducer starts on the deep
        layers early. Only the oldest unmerged call does so (a blocking loop's order)."""
        if not self.grad_hooks:
            return

        def merge_if_oldest() -> None:
            with self._runs_lock:
                oldest = bool(self._inflight) and self._inflight[0] is r
            if oldest:
                self.merge(r, masters)

        self.after_step(merge_if_oldest)

    def wait_all(self) -> None:
        for r in self.inflight():
            r.wait()

    def wait_idle(self) -> None:
        """Wait until every run in flight and the optimizer thread's queue have stopped."""
        self.wait_all()
        self.wait_tail()

    def raise_failure(self) -> None:
        """After a pipelined failure: wait until everything has stopped, drop the failed
        pipeline's gradients, put the masters into the model and raise the error once."""
        if self.failure is None:
            return
        self.wait_idle()
        with self._runs_lock:
            for r in self._inflight:
                r.buffer.take()  # dropped
            self._inflight.clear()
        exc = self.reset_after_failure()
        self.publish_all()
        if exc is not None:
            raise exc

    def publish_all(self) -> None:
        """The masters are the model's weights now (``synchronize()``)."""
        steps = self.steps
        self.versions.wait_ended_uploads()  # no DMA of a drained run still reads the copy
        # the released masters' values, from their owners (collective: a sharded rank's
        # first publication of this version, the same on every rank)
        self.versions.publish_remote(steps, lambda: False)
        self.masters.copy_to_model(skip=self.versions.remote_keys())  # (those: just written)
        self.versions.set_all(steps)
        with self._runs_lock:
            self.target_version = steps

    def _retarget(self) -> tuple[int, list[PendingResult]]:
        """A step is queued: calls issued from now on read the version before it; returns
        that version and the runs whose gradients the step consumes."""
        version = self.steps
        runs = [r for r in self.inflight() if not r.merged]
        with self._runs_lock:
            self.target_version = version
        return version, runs

    def defer_step(self, step_fn: Callable[[], Any]) -> None:
        """Queue the publication of the last step's weights, then the step itself once the
        gradients of the runs issued before it are complete."""
        version, runs = self._retarget()
        versions = self.versions
        self.queue(
            lambda: versions.publish(version, lambda: self.failure is not None),
            guarded=True,
            step=False,
            publishes=True,
        )

        def deferred_step() -> None:
            for r in runs:
                r.wait()
                if r.error is not None:
                    raise r.error
            failure = self.failure
            if failure is not None:
                raise failure
            for r in runs:
                self.merge(r)
            step_fn()

        self.queue(deferred_step, guarded=True)

    def queue_publish_then_step(self, step_fn: Callable[[], Any]) -> None:
        """After blocking calls: queue, as one plain step, the copy of the last step's
        weights into the model, then ``step_fn`` (a blocking call issued meanwhile waits
        for each layer's copy). If the step before failed, neither runs: the model keeps
        the last completed step's weights and the next ``step()`` / ``synchronize()``
        raises the error."""
        version, _ = self._retarget()
        previous = self.pending()
        versions = self.versions

        def publish_then_step() -> None:
            if previous is not None:
                previous.result()  # its error skips this step and is raised in its place
            versions.publish(version, lambda: False)
            step_fn()

        self.queue(publish_then_step, guarded=False, publishes=True)
        publication = self.last_publication()
        if publication is not None:  # a blocking upload waiting for a skipped copy wakes up
            publication.add_done_callback(lambda _: versions.notify())

    def defer_layerwise_step(
        self,
        step_params: Callable[[list[nn.Parameter]], Any],
        finish: Callable[[], Any] | None,
        wrap: Callable[[Callable[[], None]], Callable[[], None]],
    ) -> None:
        """As :meth:`defer_step`, stepping each parameter as soon as its gradients are
        complete, in one work item (``layerwise.run_layerwise``)."""
        version, runs = self._retarget()
        item = functools.partial(
            run_layerwise,
            self.versions,
            self.masters,
            self,
            runs,
            version,
            step_params,
            self.merge,
            finish,
        )
        self.queue(wrap(item), guarded=True, publishes=True)

    def result_of(self, r: PendingResult) -> Any:
        """``r.result()``: raise its error, or merge it (and the runs before it)."""
        if r.error is not None:
            self.mark_reported(r.error)
            raise r.error
        if r.prev_step is not None:
            r.prev_step.exception()  # that step consumed the gradients before these
        if not r.merged and self.failure is not None:
            self.raise_failure()  # its gradients were dropped with the failed pipeline
        with self._runs_lock:
            # runs issued after the same step, up to this one, go into .grad together
            earlier = self._inflight[: self._inflight.index(r) + 1] if r in self._inflight else []
        for e in earlier:
            e.wait()  # never under a lock: a run's completion callback takes them
        for e in earlier:
            self.merge(e)
        return r.assembled()


class RunFinisher:
    """Completion of a pipelined run (on its last worker's thread): its timing
    (``rp._call_done``), failure bookkeeping. Holds its RoundPipe weakly."""

    def __init__(self, rp: Any, jobs: list[Any], t0: float, extent: tuple[int, int]) -> None:
        self._rp = weakref.ref(rp)
        self._steps = rp._steps
        self.jobs, self.t0 = jobs, t0
        self.extent = extent  # the call's (samples, tokens)

    def __call__(self, p: PendingResult) -> None:
        run = p.run
        rp = self._rp()
        if rp is not None:
            rp._call_done(run, self.jobs, self.t0, self.extent, ok=p.error is None)
        run.drop_activations()  # the handle keeps losses and outputs only
        self._steps.call_ended(p)  # its weight readers released, its error reported
