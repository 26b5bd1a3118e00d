"""Stepping the optimizer layer by layer, as each layer's gradients complete.

With overlapped iterations and the one-step-stale update, iteration k+2 needs step k's
weights; a step taken in one call starts only once iteration k's last gradient (the
first layers') is in. The backward completes the deepest layers first: stepping each
parameter as soon as its gradient is complete in every iteration of the window hides
most of the step behind the rest of the backward (``benchmarks/planner.py``).

``RoundPipe.step_layerwise(step_params)`` steps *some* masters at a time, which equals
one step only for an optimizer whose update of a parameter reads nothing but its
gradient and state (:func:`steps_elementwise`: Adam, SGD; not LBFGS, not global norm
clipping). The optimizer thread runs one work item per step (:func:`run_layerwise`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from ..planning.schedule import Job

if TYPE_CHECKING:
    from .masters import MasterWeights
    from .stepper import Stepper
    from .versions import WeightVersions

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "GradCompletion",
    "run_layerwise",
    "step_subset",
    "steps_elementwise",
]

#: torch optimizers whose step updates each parameter from its own gradient and state
#: only, so stepping the parameters in several calls equals one call
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adadelta,
    torch.optim.Adagrad,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.SGD,
)

_WAIT_SLICE_S = 0.05


def steps_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` over a subset of its parameters at a time equals one
    ``step()``: one of :data:`ELEMENTWISE_OPTIMIZERS` with torch's own ``step``, or a
    class declaring ``roundpipe_elementwise = True``; and no step hooks (they would run
    once per subset)."""
    cls = type(optimizer)
    declared = getattr(cls, "roundpipe_elementwise", None) is True
    if not declared and not any(cls.step is base.step for base in ELEMENTWISE_OPTIMIZERS):
        return False
    hooks = (
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
    )
    return not any(hooks)


def step_subset(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], **kwargs: Any
) -> Any:
    """``optimizer.step(**kwargs)`` over those of its parameters in ``params`` (the others'
    ``.grad`` and state are not read). Where :func:`steps_elementwise` holds, stepping
    disjoint subsets that cover all parameters equals one ``step()``."""
    ids = {id(p) for p in params}
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) in ids]
        return optimizer.step(**kwargs)
    finally:
        for g, ps in zip(groups, saved):
            g["params"] = ps


class GradCompletion:
    """The one gradient countdown of a call: a master's gradient is complete once every
    backward job holding one of its layers has downloaded its gradients (the layer-wise
    step reads :meth:`complete`; hooks and the reducer hear of it, ``on_complete``).

    Args:
        jobs: the call's schedule.
        masters_of: the masters of a job's layers.
        notify: called (from a worker) when masters complete.
        on_complete: called (from a worker) with the masters a job completed.
    """

    def __init__(
        self,
        jobs: Sequence[Job],
        masters_of: Callable[[Job], list[nn.Parameter]],
        notify: Callable[[], None] | None = None,
        on_complete: Callable[[list[nn.Parameter]], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._notify = notify
        self._on_complete = on_complete
        # backward job index -> its masters; the backward jobs done. C-level passes, and a
        # job's countdown one set insert: per master Python steps showed as cost per job
        self._owners = {job.index: masters_of(job) for job in jobs if job.kind != "forward"}
        self._done: set[int] = set()
        every = list(chain.from_iterable(self._owners.values()))
        self.masters = dict(zip(map(id, every), every))
        # master id -> the backward job holding it; masters that several hold (a shared
        # parameter, a stage's replicas) -> all of them, counted down under the lock
        self._job_of: dict[int, int] = {}
        for index, ms in self._owners.items():
            self._job_of.update(zip(map(id, ms), repeat(index)))
        self._shared: dict[int, list[int]] = {}
        if len(self.masters) < len(every):
            for index, ms in self._owners.items():
                for m in ms:
                    self._shared.setdefault(id(m), []).append(index)
            self._shared = {k: js for k, js in self._shared.items() if len(js) > 1}

    def job_done(self, job: Job) -> None:
        """``job``'s gradients are in the run's buffer (a worker's ``grads_done``)."""
        masters = self._owners.get(job.index)
        if not masters:
            return
        if not self._shared:
            self._done.add(job.index)
            final = list(masters)
        else:
            with self._lock:
                self._done.add(job.index)
                final = [m for m in masters if self._complete_locked(id(m))]
        if final:
            if self._notify is not None:
                self._notify()
            if self._on_complete is not None:
                self._on_complete(final)

    def _complete_locked(self, master_id: int) -> bool:
        jobs = self._shared.get(master_id) or (self._job_of.get(master_id),)
        return all(j is None or j in self._done for j in jobs)

    def complete(self, master_id: int) -> bool:
        with self._lock:
            return self._complete_locked(master_id)


class LayerwiseRun(Protocol):
    """What the layer-wise step reads of an in-flight run (a ``PendingResult``)."""

    error: BaseException | None
    completion: GradCompletion | None

    @property
    def buffer(self) -> Any: ...

    def done(self) -> bool: ...


def _complete_in(runs: Sequence[LayerwiseRun], master_id: int) -> bool:
    for r in runs:
        if r.done():
            continue  # a finished run's gradients are all in its buffer
        if r.completion is None or not r.completion.complete(master_id):
            return False
    return True


def run_layerwise(
    versions: WeightVersions,
    masters: MasterWeights,
    stepper: Stepper,
    runs: Sequence[LayerwiseRun],
    version: int,
    step_params: Callable[[list[nn.Parameter]], Any],
    merge: Callable[..., None],
    finish: Callable[[], Any] | None,
) -> None:
    """One deferred step, on the optimizer thread: publish ``version`` parameter by
    parameter, step each published one once its gradients are complete in every run
    (``merge(run, chunk)`` adds them to ``.grad`` in issue order), mark each run merged
    with ``merge(run)``, then ``finish()``."""
    by_id = {id(m): m for m in masters.params()}
    # masters published from other ranks (a sharded host state): all of them first, in
    # one collective sequence; the parameters then step as their gradients complete
    versions.publish_remote(version, lambda: stepper.failure is not None)
    to_publish = versions.stale(version)
    to_step = list(by_id)
    while to_step:
        to_publish = versions.publish_ready(version, to_publish)
        for r in runs:
            if r.error is not None:
                raise r.error
        failure = stepper.failure
        if failure is not None:
            raise failure
        with versions.cond:
            ready = [k for k in to_step if versions.version[k] >= version and _complete_in(runs, k)]
            if not ready and not versions.any_publishable(version, to_publish):
                # a worker's upload, completed gradients or a run's end notify this
                versions.cond.wait(_WAIT_SLICE_S)
                continue
        if not ready:
            continue
        chunk = [by_id[k] for k in ready]
        for r in runs:  # issue order: the sums of a blocking loop
            merge(r, chunk)  # (a result() on another thread may merge r meanwhile)
        step_params(chunk)
        done = set(ready)
        to_step = [k for k in to_step if k not in done]
    for r in runs:
        merge(r)  # nothing left to add: marks them merged
    if finish is not None:
        finish()
