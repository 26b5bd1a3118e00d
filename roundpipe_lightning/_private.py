"""Every touch of a name that Lightning or torch keep private, one function each.

Neither offers a public way to do these. Each function says why it is needed;
``tests/lightning/test_private_touches.py`` checks each one against the installed
Lightning and torch (so an upgrade that moves a name fails there, not in a user's
run) and checks that no other module of this package reaches a private name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer import call as _call
from torch.optim import Optimizer

__all__ = [
    "WrappingCheckpointIO",
    "call_before_optimizer_step_hooks",
    "defer_zero_grad",
    "is_lr_scheduler_step_wrapper",
    "lightning_log_step",
    "make_wrapper_tensor",
    "mark_lr_scheduler_step_called",
    "op_is_mutable",
    "optimizer_view",
    "replace_zero_grad",
    "restore_zero_grad",
    "uncount_saved_steps",
]

#: Lightning's base of ``AsyncCheckpointIO``: a checkpoint IO that wraps another one.
#: The strategy gives one created without an inner IO the streaming IO.
WrappingCheckpointIO = _WrappingCheckpointIO


def is_lr_scheduler_step_wrapper(fn: Any) -> bool:
    """Whether ``fn`` is the wrapper a torch LR scheduler puts on ``optimizer.step`` (on
    the instance) to notice that the step was called."""
    return bool(getattr(fn, "_wrapped_by_lr_sched", False))


def mark_lr_scheduler_step_called(optimizer: Optimizer) -> None:
    """Tell an LR scheduler watching ``optimizer`` that a step was requested: a queued
    step runs later, on another thread, and the scheduler would otherwise warn that
    ``scheduler.step()`` came before ``optimizer.step()``."""
    if is_lr_scheduler_step_wrapper(getattr(optimizer, "step", None)):
        optimizer._opt_called = True  # type: ignore[attr-defined]


def uncount_saved_steps(checkpoint: dict[str, Any], lost: int, automatic: bool) -> None:
    """Take ``lost`` optimizer steps back from a checkpoint about to be written: they
    were counted by Lightning when they were queued (it counts a step when
    ``optimizer_step`` returns) but failed on the optimizer thread, so the weights in
    the checkpoint never received them. Lightning's own counters are left alone; the
    saved ``global_step`` and the loop progress it is restored from are corrected."""
    if lost <= 0:
        return
    if isinstance(checkpoint.get("global_step"), int):
        checkpoint["global_step"] = max(0, checkpoint["global_step"] - lost)
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    if automatic:
        progress = fit.get("epoch_loop.automatic_optimization.optim_progress", {})
        progress = progress.get("optimizer", {}).get("step", {})
    else:
        progress = fit.get("epoch_loop.manual_optimization.optim_step_progress", {})
    for tracker in ("total", "current"):
        counts = progress.get(tracker)
        if isinstance(counts, dict) and isinstance(counts.get("completed"), int):
            counts["completed"] = max(0, counts["completed"] - lost)


def lightning_log_step(trainer: Any) -> int:
    """The step Lightning logs the current batch's metrics at: the optimizer steps
    before this batch (the epoch loop's ``_batches_that_stepped``, which Lightning
    increments only after ``on_train_batch_end``)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    return trainer.global_step - 1  # one optimizer: the same count


def call_before_optimizer_step_hooks(trainer: Any, optimizer: Optimizer) -> None:
    """Run the callbacks' and the LightningModule's ``on_before_optimizer_step`` the way
    Lightning's precision plugins do (its ``_after_closure`` does this and clips; an
    overlapped iteration clips later, on the optimizer thread)."""
    _call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    _call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)


def make_wrapper_tensor(cls: type, shape: torch.Size, dtype: torch.dtype) -> Any:
    """A CPU tensor subclass instance without storage (torch's wrapper-subclass
    constructor, the documented way to build a ``__torch_dispatch__`` subclass)."""
    return torch.Tensor._make_wrapper_subclass(
        cls, shape, dtype=dtype, device=torch.device("cpu"), requires_grad=False
    )


def op_is_mutable(func: Any) -> bool:
    """Whether an aten operator (as ``__torch_dispatch__`` receives it) writes into one
    of its arguments."""
    return bool(func._schema.is_mutable)


def defer_zero_grad(
    optimizer: Optimizer | LightningOptimizer, replacement: Callable[..., None] | None = None
) -> Callable[..., None]:
    """Make ``optimizer.zero_grad`` a no-op on this instance (or ``replacement``);
    returns the real one.

    Lightning calls ``optimizer.zero_grad()`` after ``training_step`` in automatic
    optimization, which would wipe what ``forward_backward`` just accumulated, and a
    manual ``zero_grad()`` would race with a step still running on the optimizer
    thread. The queued RoundPipe step calls the real one right after its update; in
    manual optimization ``replacement`` runs it in order with that step. A
    ``LightningOptimizer`` takes ``zero_grad`` from its class (the optimizer's), not
    from the wrapped instance, so it gets the replacement on itself too.
    """

    def zero_grad(set_to_none: bool = True) -> None:
        """Deferred by RoundPipeStrategy: the RoundPipe step clears the gradients."""

    return replace_zero_grad(optimizer, replacement or zero_grad)


def replace_zero_grad(
    optimizer: Optimizer | LightningOptimizer, zero_grad: Callable[..., None]
) -> Callable[..., None]:
    """Make ``optimizer.zero_grad`` (on this instance) ``zero_grad``; returns the one it
    had. The Fabric strategy's ``zero_grad`` clears the master gradients only when no
    step queued on the optimizer thread will clear them (and waits for that thread
    first), for the same reasons as :func:`defer_zero_grad`."""
    real = optimizer.zero_grad
    optimizer.zero_grad = zero_grad  # type: ignore[method-assign,union-attr]
    return real


def optimizer_view(optimizer: Optimizer, zero_grad: Callable[..., None]) -> Optimizer:
    """The optimizer as Fabric's wrapper should see it: an object of a subclass of its
    class that shares its ``__dict__`` (param groups, state, hooks: one optimizer) and
    whose ``zero_grad`` is ``zero_grad``.

    Fabric's ``_FabricOptimizer`` takes the class of the optimizer it wraps as a base
    and finds ``zero_grad`` on that class, so an instance-level ``zero_grad`` (as
    :func:`replace_zero_grad` sets) is never reached through it, and the real one would
    clear the master gradients while a queued step reads them. The user's object keeps
    its class; the view is what ``fabric.setup()`` returns wrapped.
    """
    cls = type(optimizer)

    def view_zero_grad(self: Any, set_to_none: bool = True) -> None:
        # through Fabric's wrapper ``self`` is the wrapper, whose attribute lookups fall
        # through to the view: the shared __dict__'s policy is found either way
        return self.roundpipe_zero_grad(set_to_none=set_to_none)

    view_cls = type(cls.__name__, (cls,), {"zero_grad": view_zero_grad})
    view_cls.__qualname__ = cls.__qualname__
    view_cls.__module__ = cls.__module__
    view: Optimizer = object.__new__(view_cls)
    view.__dict__ = optimizer.__dict__  # the same dict object, not a copy
    optimizer.roundpipe_zero_grad = zero_grad  # type: ignore[attr-defined]
    return view


def restore_zero_grad(optimizer: Optimizer | LightningOptimizer) -> None:
    """Undo :func:`defer_zero_grad`, :func:`replace_zero_grad` and the policy of
    :func:`optimizer_view` (at teardown)."""
    if "zero_grad" in vars(optimizer):
        del optimizer.zero_grad
    vars(optimizer).pop("roundpipe_zero_grad", None)
