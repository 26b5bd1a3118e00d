"""``RoundPipePrecision``: Lightning's precision modes under RoundPipe (what each does:
docs/precision-and-checkpoints.md); the Trainer's own plugin is converted by
:meth:`RoundPipePrecision.from_plugin`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from roundpipe_core.amp import GradScaler

from ._private import call_before_optimizer_step_hooks

__all__ = ["SUPPORTED", "LossScaler", "AmpLossScaler", "DynamicLossScaler", "RoundPipePrecision"]

SUPPORTED = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
"""Lightning precision strings RoundPipe runs."""


@runtime_checkable
class LossScaler(Protocol):
    """What the plugin needs of a loss scaler (another rule may replace :class:`AmpLossScaler`)."""

    def get_scale(self) -> float:
        """The factor the losses of the current accumulation window are multiplied by."""
        ...

    def unscale_(self, params: Iterable[Tensor]) -> bool:
        """Divide the gradients of ``params`` by the scale; True if any is not finite."""
        ...

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a window (shrink after an overflow, grow when stable)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _WindowGradients:
    """An optimizer to :class:`roundpipe_core.amp.GradScaler`: the window's masters, and a
    ``step()`` that only notes they were found finite (the real step is queued later)."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = [{"params": []}]
        self.finite = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.finite = True


class AmpLossScaler:
    """The ``16-mixed`` loss scaler: :class:`roundpipe_core.amp.GradScaler` (torch's
    ``GradScaler`` arithmetic and state dict, plus ``skipped_steps``; thread-safe) behind
    the :class:`LossScaler` protocol. It runs on the training thread between the window
    and the queued step, so the scale is final before the next window's losses are
    scaled and the optimizer thread is never waited for.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.
        grad_scaler: use this ``roundpipe_core.amp.GradScaler`` (the four settings above
            are then ignored).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        grad_scaler: GradScaler | None = None,
    ) -> None:
        if grad_scaler is None:
            if (
                not init_scale > 0
                or not growth_factor > 1.0
                or not 0.0 < backoff_factor < 1.0
                or not isinstance(growth_interval, int)
                or growth_interval < 1
            ):
                raise ValueError(
                    "loss scaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                    "and an int growth_interval >= 1; got "
                    f"{init_scale}, {growth_factor}, {backoff_factor}, {growth_interval!r}"
                )
            grad_scaler = GradScaler(init_scale, growth_factor, backoff_factor, growth_interval)
        elif not isinstance(grad_scaler, GradScaler):
            raise TypeError(
                f"grad_scaler must be a roundpipe_core.amp.GradScaler, got {type(grad_scaler).__name__}"
            )
        self.grad_scaler = grad_scaler
        self.skipped_steps = 0
        self._window = _WindowGradients()
        self._checked = False

    @classmethod
    def from_grad_scaler(cls, scaler: GradScaler | torch.amp.GradScaler) -> AmpLossScaler:
        """Wrap a ``roundpipe_core.amp.GradScaler``, or take the settings and scale of a
        ``torch.amp.GradScaler`` (Lightning's plugin's)."""
        if isinstance(scaler, GradScaler):
            return cls(grad_scaler=scaler)
        return cls(
            init_scale=float(scaler.get_scale()) if scaler.is_enabled() else 2.0**16,
            growth_factor=float(scaler.get_growth_factor()),
            backoff_factor=float(scaler.get_backoff_factor()),
            growth_interval=int(scaler.get_growth_interval()),
        )

    @property
    def scale(self) -> float:
        return self.get_scale()

    def get_scale(self) -> float:
        return float(self.grad_scaler.get_scale())

    def unscale_(self, params: Iterable[Tensor]) -> bool:
        window = self._window
        window.param_groups = [{"params": [p for p in params if p.grad is not None]}]
        window.finite = False
        try:
            if not window.param_groups[0]["params"]:
                self._checked = False  # nothing to check: the scale stays as it is
                return False
            # unscale, check for inf/NaN and "step" only if finite: GradScaler's own rule
            self.grad_scaler.step(window)  # type: ignore[arg-type]  # duck-typed optimizer
            self._checked = True
            return not window.finite
        finally:
            window.param_groups = [{"params": []}]  # hold no parameters between windows

    def update(self, found_inf: bool) -> None:
        if not self._checked:
            return
        self._checked = False
        self.skipped_steps += bool(found_inf)
        # the window's check was recorded by unscale_ on this thread: resolves at once
        self.grad_scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {**self.grad_scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "_growth_tracker" not in state and "growth_tracker" in state:
            state["_growth_tracker"] = state["growth_tracker"]  # the earlier scaler's key
        defaults = self.grad_scaler.state_dict()
        for key in ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
            state.setdefault(key, defaults.get(key, 0))
        self.grad_scaler.load_state_dict(state)
        self.skipped_steps = int(state.get("skipped_steps", 0))


# the name RoundPipePrecision(scaler=DynamicLossScaler(...)) was written with
DynamicLossScaler = AmpLossScaler


class RoundPipePrecision(Precision):
    """Precision plugin of :class:`~roundpipe_lightning.RoundPipeStrategy`.

    Args:
        precision: one of ``SUPPORTED`` ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true").
        scaler: the loss scaler of ``16-mixed``: a :class:`LossScaler`, or a
            ``roundpipe_core.amp.GradScaler`` / ``torch.amp.GradScaler`` (wrapped in an
            :class:`AmpLossScaler`); default ``AmpLossScaler()``. None for the other modes.
        device: device type autocast is entered for on the main thread ("cpu" or "cuda");
            the engine enters the same dtype on each worker's own device type.
    """

    def __init__(
        self,
        precision: str = "32-true",
        scaler: LossScaler | GradScaler | torch.amp.GradScaler | None = None,
        device: str = "cpu",
    ) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"RoundPipePrecision(precision={precision!r}) is not supported; use one of "
                f"{', '.join(repr(s) for s in SUPPORTED)}"
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(
                f"a loss scaler is only used with precision='16-mixed', got precision={precision!r}"
            )
        if isinstance(scaler, (GradScaler, torch.amp.GradScaler)):
            scaler = AmpLossScaler.from_grad_scaler(scaler)
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(
                "scaler must provide get_scale(), unscale_(params), update(found_inf), state_dict() "
                f"and load_state_dict() (roundpipe_lightning.precision.LossScaler), got "
                f"{type(scaler).__name__}"
            )
        self.precision = precision  # type: ignore[assignment]
        default = AmpLossScaler() if precision == "16-mixed" else None
        self.scaler: LossScaler | None = default if scaler is None else scaler
        # Lightning's plugin for the mode, whose conversions and contexts are reused (a
        # MixedPrecision's GradScaler stays unused: our LossScaler unscales the masters)
        if precision == "32-true":
            self._lightning: Precision = Precision()
        elif precision in ("16-true", "bf16-true"):
            self._lightning = HalfPrecision(precision)  # type: ignore[arg-type]
        else:
            self._lightning = MixedPrecision(precision, device)  # type: ignore[arg-type]

    @classmethod
    def from_plugin(cls, plugin: Precision | None) -> RoundPipePrecision:
        """The RoundPipe counterpart of a Lightning precision plugin (the Trainer's); a
        ValueError for one it cannot run (64-bit, Transformer Engine, custom, ...)."""
        if plugin is None or type(plugin) is Precision:
            return cls("32-true")
        if isinstance(plugin, RoundPipePrecision):
            return plugin
        if type(plugin) is HalfPrecision:
            return cls(plugin.precision)
        if type(plugin) is MixedPrecision:  # (its scaler: 16-mixed's GradScaler, else None)
            out = cls(plugin.precision, scaler=plugin.scaler, device=plugin.device)
            out._lightning = plugin  # the user's own autocast settings (device)
            return out
        name = getattr(plugin, "precision", None)
        raise ValueError(
            f"RoundPipeStrategy does not support the precision plugin {type(plugin).__name__}"
            f"{f' (precision={name!r})' if name else ''}. Use Trainer(precision=...) with one of "
            f"{', '.join(repr(s) for s in SUPPORTED)}."
        )

    # -- loss scale ------------------------------------------------------------------------
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    # -- module and contexts: Lightning's own plugin for the mode -----------------------------
    @override
    def convert_module(self, module: Module) -> Module:
        return self._lightning.convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self._lightning.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self._lightning.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        # entered on the main thread around the step methods; the engine captures the
        # autocast state there and re-enters it on its worker threads
        return self._lightning.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self._lightning.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self._lightning.convert_output(data)

    # -- backward ----------------------------------------------------------------------------
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # only a loss with a graph (``self.roundpipe(x)``) is backpropagated here; a
        # forward_backward loss was scaled by the strategy's loss multiplier
        if self.scaler is not None and tensor.requires_grad:
            tensor = tensor * self.loss_scale()
        return super().pre_backward(tensor, module)

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # A forward_backward loss is detached: the engine already backpropagated it.
        if tensor.requires_grad:
            super().backward(tensor, model, optimizer, *args, **kwargs)

    # -- optimizer step ----------------------------------------------------------------------
    def prepare_step(
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        defer_clipping: bool = False,
    ) -> tuple[Any, bool]:
        """Everything of a step but ``optimizer.step()``: the closure, unscaling, the
        hooks, clipping (``defer_clipping``: left to :meth:`clip_masters` on the optimizer
        thread), the scale's update. Returns ``(closure_result, do_update)``; no update
        for a closure that returned None (automatic optimization) or an overflow."""
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        found_inf = False
        if self.scaler is not None and not skip:
            found_inf = self.scaler.unscale_(p for g in optimizer.param_groups for p in g["params"])
        if defer_clipping:
            call_before_optimizer_step_hooks(model.trainer, optimizer)
        else:
            self._after_closure(model, optimizer)  # hooks and clipping, as Lightning's
        if self.scaler is not None and not skip:
            self.scaler.update(found_inf)
        return closure_result, not (skip or found_inf)

    clip_norm_fn: Callable[[Optimizer, float], Any] | None = None
    """Set by ``RoundPipeStrategy(shard_host_state=True)``: clips by the norm over every
    process's share of the gradients (each holds only its own)."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.clip_norm_fn is not None:
            self.clip_norm_fn(optimizer, float(clip_val))
            return
        super().clip_grad_by_norm(optimizer, clip_val)

    @staticmethod
    def clip_masters(optimizer: Optimizer, model: pl.LightningModule) -> None:
        """Clip the master gradients as the Trainer's ``gradient_clip_*`` say (what an
        unoverridden ``configure_gradient_clipping`` does)."""
        if model.trainer.gradient_clip_val:
            model.clip_gradients(optimizer)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """A synchronous step (RoundPipeStrategy queues the step on RoundPipe instead)."""
        closure_result, do_update = self.prepare_step(optimizer, model, closure)
        if do_update:
            optimizer.step(**kwargs)
        return closure_result
