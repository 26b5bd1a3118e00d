"""Precision modes under RoundPipe.

The engine runs model code on worker threads, so what Lightning's precision
plugins do on the main thread has to be redone where the layers run:

* ``32-true``: nothing to do.
* ``16-true`` / ``bf16-true``: Lightning casts the module to half precision
  before the strategy wraps it; RoundPipe keeps fp32 master copies
  (``optim_dtype``), so the optimizer updates fp32 weights.
* ``bf16-mixed`` / ``16-mixed``: fp32 weights, layers run under
  ``torch.autocast``. Autocast state is thread-local, so it is entered by
  forward hooks on each layer (they run on whichever worker runs the layer,
  in forward and in recompute alike).
* ``16-mixed`` also scales the loss (:class:`DynamicLossScaler`): the strategy
  multiplies every microbatch loss by the scale, unscales the master gradients
  before clipping and the step, and skips steps whose gradients overflowed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn

SUPPORTED = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


@dataclass(frozen=True)
class PrecisionMode:
    """What the strategy does for the Trainer's precision plugin.

    Attributes:
        name: Lightning's precision string.
        autocast_dtype: dtype layers run under ``torch.autocast`` (None: no autocast).
        loss_scaling: whether losses are scaled dynamically (``16-mixed``).
    """

    name: str
    autocast_dtype: torch.dtype | None = None
    loss_scaling: bool = False


def resolve_precision(plugin: Precision) -> PrecisionMode:
    """Map the Trainer's precision plugin to a :class:`PrecisionMode`.

    Raises:
        ValueError: for plugins RoundPipe cannot run (64-bit, Transformer Engine,
            bitsandbytes, DeepSpeed/FSDP/XLA precision, custom plugins).
    """
    if type(plugin) is Precision:
        return PrecisionMode("32-true")
    if type(plugin) is HalfPrecision:
        return PrecisionMode(plugin.precision)
    if type(plugin) is MixedPrecision:
        if plugin.precision == "bf16-mixed":
            return PrecisionMode("bf16-mixed", autocast_dtype=torch.bfloat16)
        return PrecisionMode("16-mixed", autocast_dtype=torch.float16, loss_scaling=True)
    name = getattr(plugin, "precision", None)
    raise ValueError(
        f"RoundPipeStrategy does not support the precision plugin {type(plugin).__name__}"
        f"{f' (precision={name!r})' if name else ''}. Use Trainer(precision=...) with one of "
        f"{', '.join(repr(s) for s in SUPPORTED)}."
    )


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
            init_scale <= 0
            or growth_factor <= 1.0
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
    def from_plugin(cls, plugin: MixedPrecision) -> DynamicLossScaler:
        """Take the settings of the plugin's ``torch.amp.GradScaler`` (if it has one)."""
        scaler = getattr(plugin, "scaler", None)
        if scaler is None:
            return cls()
        return cls(
            init_scale=float(getattr(scaler, "_init_scale", 2.0**16)),
            growth_factor=float(getattr(scaler, "_growth_factor", 2.0)),
            backoff_factor=float(getattr(scaler, "_backoff_factor", 0.5)),
            growth_interval=int(getattr(scaler, "_growth_interval", 2000)),
        )

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients of ``params`` by the scale; True if any is not finite."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        found = torch.zeros(1, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        with torch.no_grad():
            # one fused pass per device and dtype (the kernel torch's GradScaler uses)
            by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
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


_AUTOCAST = threading.local()


def _first_tensor_device(value: Any) -> torch.device | None:
    stack = [value]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            return x.device
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return None


def install_autocast(layers: Iterable[nn.Module], dtype: torch.dtype) -> list[Any]:
    """Run each layer under ``torch.autocast(<device of its input>, dtype)``.

    Forward hooks travel with the layer: the engine's per-device copies of a
    layer are deep copies that keep them, so the autocast is entered on the
    worker thread that runs the layer, in forward and in recompute.

    Returns:
        The hook handles; ``remove_hooks(handles)`` takes them off again.
    """

    def enter(module: nn.Module, args: Any, kwargs: Any) -> None:
        device = _first_tensor_device((args, kwargs))
        if device is None:
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
        ctx = torch.autocast(device.type, dtype=dtype, cache_enabled=False)
        ctx.__enter__()
        stack = getattr(_AUTOCAST, "stack", None)
        if stack is None:
            stack = _AUTOCAST.stack = []
        stack.append(ctx)

    def leave(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        stack = getattr(_AUTOCAST, "stack", None)
        if stack:
            stack.pop().__exit__(None, None, None)

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(layer.register_forward_hook(leave, with_kwargs=True, always_call=True))
    return handles


def remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
