"""``RoundPipePrecision``: Lightning's precision modes under RoundPipe.

The plugin owns everything precision-specific of a RoundPipe run:

* ``32-true``: nothing to do.
* ``16-true`` / ``bf16-true``: the module is cast to half precision before the
  strategy wraps it; RoundPipe keeps fp32 master copies (``optim_dtype``), so the
  optimizer updates fp32 weights.
* ``bf16-mixed`` / ``16-mixed``: fp32 weights, layers run under ``torch.autocast``.
  The plugin enters autocast around ``training_step`` / ``validation_step`` on
  the main thread (as Lightning's ``MixedPrecision`` does) and the engine carries
  the caller's autocast state to the worker threads that run the layers.
* ``16-mixed`` also scales the loss dynamically (a :class:`LossScaler`): every
  microbatch loss is multiplied by the scale (the strategy's loss multiplier),
  the master gradients are unscaled before clipping and the step, and a step
  whose gradients overflowed is skipped.

The Trainer's own plugin (``precision="bf16-mixed"``, ``plugins=[MixedPrecision(...)]``)
is converted by :meth:`RoundPipePrecision.from_plugin` when the strategy receives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["SUPPORTED", "LossScaler", "DynamicLossScaler", "RoundPipePrecision"]

SUPPORTED = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
"""Lightning precision strings RoundPipe runs."""


@runtime_checkable
class LossScaler(Protocol):
    """What the plugin needs of a loss scaler (so another implementation -- e.g. one
    shaped like ``torch.amp.GradScaler`` -- can replace :class:`DynamicLossScaler`)."""

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


class DynamicLossScaler:
    """Dynamic loss scaling on the master gradients (the ``16-mixed`` recipe).

    The loss is multiplied by ``scale`` before backward. Before the step the
    master gradients are divided by it and checked: if any is inf/NaN the step
    is skipped and the scale shrinks by ``backoff_factor``; after
    ``growth_interval`` clean steps in a row it grows by ``growth_factor``.
    Everything happens on the main thread between the accumulation window and
    the (possibly asynchronous) optimizer step, so the scale a window used is
    the scale it is unscaled with.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if (
            not init_scale > 0
            or not growth_factor > 1.0
            or not 0.0 < backoff_factor < 1.0
            or growth_interval < 1
        ):
            raise ValueError(
                "DynamicLossScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                f"and growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0
        self.skipped_steps = 0

    @classmethod
    def from_grad_scaler(cls, scaler: Any | None) -> DynamicLossScaler:
        """Take the settings of a ``torch.amp.GradScaler`` (defaults for None)."""
        if scaler is None:
            return cls()
        return cls(
            init_scale=float(getattr(scaler, "_init_scale", 2.0**16)),
            growth_factor=float(getattr(scaler, "_growth_factor", 2.0)),
            backoff_factor=float(getattr(scaler, "_backoff_factor", 0.5)),
            growth_interval=int(getattr(scaler, "_growth_interval", 2000)),
        )

    def get_scale(self) -> float:
        return self.scale

    def unscale_(self, params: Iterable[Tensor]) -> bool:
        """Divide the gradients of ``params`` by the scale; True if any is not finite."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        found = torch.zeros(1, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        with torch.no_grad():
            # one fused pass per device and dtype (the kernel torch's GradScaler uses)
            by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for g in grads:
                by_key.setdefault((g.device, g.dtype), []).append(g)
            for (device, _), group in by_key.items():
                f = found if device == found.device else torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(group, f, inv.to(device))
                if f is not found:
                    found += f.to(found.device)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Shrink the scale after an overflow, grow it after enough clean steps."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, 1e-30)
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "growth_tracker": self.growth_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _lightning_plugin(precision: str, device: str) -> Precision:
    """Lightning's own plugin for ``precision``: it provides the module conversion and
    the forward contexts (default dtype, autocast) that RoundPipePrecision reuses."""
    if precision == "32-true":
        return Precision()
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)  # type: ignore[arg-type]
    # its GradScaler stays unused: the master gradients are unscaled by our LossScaler
    return MixedPrecision(precision, device)  # type: ignore[arg-type]


class RoundPipePrecision(Precision):
    """Precision plugin of :class:`~roundpipe_lightning.RoundPipeStrategy` (see the module docstring).

    Args:
        precision: one of ``SUPPORTED`` ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true").
        scaler: the loss scaler of ``16-mixed`` (default: a :class:`DynamicLossScaler`);
            must be None for the other modes.
        device: device type autocast is entered for on the main thread ("cpu" or "cuda");
            the engine enters the same dtype on each worker's own device type.
    """

    def __init__(
        self, precision: str = "32-true", scaler: LossScaler | None = None, device: str = "cpu"
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
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(
                "scaler must provide get_scale(), unscale_(params), update(found_inf), state_dict() "
                f"and load_state_dict() (roundpipe_lightning.precision.LossScaler), got "
                f"{type(scaler).__name__}"
            )
        self.precision = precision  # type: ignore[assignment]
        self.scaler: LossScaler | None = scaler
        if precision == "16-mixed" and scaler is None:
            self.scaler = DynamicLossScaler()
        self._lightning = _lightning_plugin(precision, device)

    @classmethod
    def from_plugin(cls, plugin: Precision | None) -> RoundPipePrecision:
        """The RoundPipe counterpart of a Lightning precision plugin (the Trainer's).

        Raises:
            ValueError: for plugins RoundPipe cannot run (64-bit, Transformer Engine,
                bitsandbytes, DeepSpeed/FSDP/XLA precision, custom plugins).
        """
        if plugin is None or type(plugin) is Precision:
            return cls("32-true")
        if isinstance(plugin, RoundPipePrecision):
            return plugin
        if type(plugin) is HalfPrecision:
            return cls(plugin.precision)
        if type(plugin) is MixedPrecision:
            scaler = None
            if plugin.precision == "16-mixed":
                scaler = DynamicLossScaler.from_grad_scaler(plugin.scaler)
            out = cls(plugin.precision, scaler=scaler, device=plugin.device)
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
        """The factor on the losses of the current window (1.0 without a scaler)."""
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
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # entered on the main thread around the step methods; the engine captures the
        # autocast state there and re-enters it on its worker threads
        with self._lightning.forward_context():
            yield

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
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any]
    ) -> tuple[Any, bool]:
        """Everything of an optimizer step except ``optimizer.step()`` itself, on the
        calling thread: run the closure (training_step and backward), unscale the
        gradients, call ``on_before_optimizer_step`` and clip, update the loss scale.

        Returns:
            ``(closure_result, do_update)``: ``do_update`` is False when the step must be
            skipped (the closure returned None in automatic optimization, or the scaled
            gradients overflowed).
        """
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        found_inf = False
        if self.scaler is not None and not skip:
            found_inf = self.scaler.unscale_(p for g in optimizer.param_groups for p in g["params"])
        self._after_closure(model, optimizer)  # hooks + gradient clipping, as Lightning's plugins
        if self.scaler is not None and not skip:
            self.scaler.update(found_inf)
        return closure_result, not (skip or found_inf)

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
