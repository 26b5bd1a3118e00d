"""An optimizer step queued on RoundPipe's optimizer thread, with the hyperparameters
it was queued with.

With ``async_step=True`` the strategy's ``optimizer_step`` returns before
``optimizer.step()`` has run, and Lightning then steps the LR schedulers on the
main thread. Reading ``param_groups`` on the optimizer thread would race with
that write and pick up the *next* step's learning rate. So the param groups are
copied when the step is queued, and while the queued step runs, the optimizer's
``param_groups`` read *on that thread* is the copy; every other thread (the
schedulers, ``LearningRateMonitor``) keeps seeing and writing the live groups.
Entries the step itself writes into its groups are carried back afterwards.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["QueuedStep", "release", "mark_step_requested", "uncount_last_step"]

_local = threading.local()


class _ThreadGroups:
    """``param_groups`` of an optimizer: the queued step's copy on the thread running
    that step, the instance's own list everywhere else."""

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        current = getattr(_local, "step", None)
        if current is not None and current[0] is obj:
            return current[1]
        return obj.__dict__["param_groups"]

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__["param_groups"] = value


_SUBCLASSES: dict[type, type] = {}


def _install(optimizer: Optimizer) -> None:
    """Give ``optimizer`` a same-named subclass whose ``param_groups`` is per-thread
    (an instance attribute cannot be; the class is restored by :func:`release`)."""
    cls = type(optimizer)
    if isinstance(cls.__dict__.get("param_groups"), _ThreadGroups):
        return
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "param_groups": _ThreadGroups(),
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_roundpipe_base": cls,
            },
        )
    optimizer.__class__ = sub


def release(optimizer: Optimizer) -> None:
    """Give ``optimizer`` its own class back (at teardown)."""
    base = type(optimizer).__dict__.get("_roundpipe_base")
    if base is not None:
        optimizer.__class__ = base


def _frozen(value: Any) -> Any:
    # schedulers update tensor learning rates in place (``lr.fill_``)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class QueuedStep:
    """``optimizer.step(**kwargs)`` with the hyperparameters the param groups hold now.

    Create it on the main thread when the step is queued; call :meth:`run` on the
    optimizer thread.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        _install(optimizer)
        self.optimizer = optimizer
        live = optimizer.param_groups
        self.hyper = [{k: _frozen(v) for k, v in g.items() if k != "params"} for g in live]
        self.groups = [{**h, "params": g["params"]} for h, g in zip(self.hyper, live)]
        self.live = list(live)

    def run(self, **kwargs: Any) -> Any:
        opt = self.optimizer
        _local.step = (opt, self.groups)
        try:
            out = opt.step(**kwargs)
        finally:
            _local.step = None
        # entries the step wrote into its groups (step counters of some optimizers)
        for h, g, target in zip(self.hyper, self.groups, self.live):
            for key, value in g.items():
                if key != "params" and (key not in h or h[key] is not value):
                    target[key] = value
        return out


def mark_step_requested(optimizer: Optimizer) -> None:
    """Tell an LR scheduler watching ``optimizer`` that a step was requested: it warns
    about ``scheduler.step()`` before ``optimizer.step()`` otherwise, since the queued
    step runs later, on another thread."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True  # type: ignore[attr-defined]


def uncount_last_step(trainer: Any) -> None:
    """Take back the last optimizer step from ``trainer.global_step``: it was counted when
    it was queued (Lightning counts a step when ``optimizer_step`` returns) but failed on
    the optimizer thread, so the weights never received it."""
    lm = trainer.lightning_module
    loop = trainer.fit_loop.epoch_loop
    if lm.automatic_optimization:
        progress = loop.automatic_optimization.optim_progress.optimizer.step
    else:
        progress = loop.manual_optimization.optim_step_progress
    for tracker in (progress.total, progress.current):
        tracker.completed = max(0, tracker.completed - 1)
