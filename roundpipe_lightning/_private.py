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

#: Lightning's base of ``AsyncCheckpointIO``: a checkpoint IO that wraps another one.
#: The strategy gives one created without an inner IO the streaming IO.
WrappingCheckpointIO = _WrappingCheckpointIO


def is_lr_scheduler_step_wrapper(fn: Any) -> bool:
    """Whether ``fn`` is the wrapper a torch LR scheduler puts on ``optimizer.step``."""
    return bool(getattr(fn, "_wrapped_by_lr_sched", False))


def mark_lr_scheduler_step_called(optimizer: Optimizer) -> None:
    """Tell an LR scheduler that a step was requested (a queued step runs later, and the
    scheduler would warn that ``scheduler.step()`` came before ``optimizer.step()``)."""
    if is_lr_scheduler_step_wrapper(getattr(optimizer, "step", None)):
        optimizer._opt_called = True  # type: ignore[attr-defined]


def uncount_saved_steps(checkpoint: dict[str, Any], lost: int, automatic: bool) -> None:
    """Take ``lost`` steps (counted when queued, failed on the optimizer thread) back from
    a checkpoint's ``global_step`` and loop progress; Lightning's counters stay."""
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
    """The step Lightning logs this batch's metrics at (``_batches_that_stepped``,
    incremented only after ``on_train_batch_end``)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    return trainer.global_step - 1  # one optimizer: the same count


def call_before_optimizer_step_hooks(trainer: Any, optimizer: Optimizer) -> None:
    """``on_before_optimizer_step`` of the callbacks and the module, as Lightning's
    ``_after_closure`` calls it, without its clipping (done later when overlapped)."""
    _call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    _call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)


def make_wrapper_tensor(cls: type, shape: torch.Size, dtype: torch.dtype) -> Any:
    """A CPU tensor subclass instance without storage (for ``__torch_dispatch__``)."""
    return torch.Tensor._make_wrapper_subclass(
        cls, shape, dtype=dtype, device=torch.device("cpu"), requires_grad=False
    )


def op_is_mutable(func: Any) -> bool:
    """Whether an aten operator writes into one of its arguments."""
    return bool(func._schema.is_mutable)


def defer_zero_grad(
    optimizer: Optimizer | LightningOptimizer, replacement: Callable[..., None] | None = None
) -> Callable[..., None]:
    """Make ``optimizer.zero_grad`` a no-op on this instance (or ``replacement``);
    returns the real one. Lightning's ``zero_grad()`` after ``training_step`` would wipe
    what ``forward_backward`` accumulated, and a manual one would race with a queued
    step: that step calls the real one right after its update (``replacement`` runs it
    in order with the step). A ``LightningOptimizer`` gets it on itself too: it takes
    ``zero_grad`` from its class, not from the wrapped instance."""

    def zero_grad(set_to_none: bool = True) -> None:
        """Deferred by RoundPipeStrategy: the RoundPipe step clears the gradients."""

    real = optimizer.zero_grad
    optimizer.zero_grad = replacement or zero_grad  # type: ignore[method-assign,union-attr]
    return real


def optimizer_view(optimizer: Optimizer, zero_grad: Callable[..., None]) -> Optimizer:
    """The optimizer as Fabric's wrapper should see it: of a subclass of its class whose
    ``zero_grad`` is ``zero_grad``, sharing its ``__dict__`` (one optimizer). Fabric's
    ``_FabricOptimizer`` finds ``zero_grad`` on the wrapped class, never on the instance,
    and the real one would clear the gradients a queued step reads."""
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
    """Undo :func:`defer_zero_grad` and the policy of :func:`optimizer_view`."""
    if "zero_grad" in vars(optimizer):
        del optimizer.zero_grad
    vars(optimizer).pop("roundpipe_zero_grad", None)
