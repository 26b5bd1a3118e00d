"""Overlapped iterations of :class:`~roundpipe_lightning.RoundPipeStrategy`
(``async_step=True, overlap_iterations=True``): ``training_step``'s ``forward_backward``
issued non-blocking through the engine's ``forward_backward_hook``, as a :class:`LazyLoss`."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from roundpipe_core.stepping.layerwise import steps_elementwise

from ._private import make_wrapper_tensor, op_is_mutable


def steps_in_parts(optimizer: Optimizer, module: pl.LightningModule) -> bool:
    """Whether an overlapped iteration's step may run layer by layer as the gradients
    complete (``RoundPipe.step_layerwise``): an elementwise optimizer and no clipping
    (the global norm needs every gradient first)."""
    if module.trainer.gradient_clip_val or is_overridden(
        "configure_gradient_clipping", module, pl.LightningModule
    ):
        return False
    return steps_elementwise(optimizer)


class LazyLoss(torch.Tensor):
    """The loss of a non-blocking ``forward_backward`` as a tensor. Pure operations on it
    (``detach``, arithmetic, casts: what ``self.log`` and Lightning's loop do) return
    further lazy tensors; anything that needs the number (``float()``, ``.item()``,
    printing, an in-place write) waits for the iteration and computes it once. Shape and
    dtype are known up front; the value is checked against them."""

    _thunk: Callable[[], torch.Tensor] | None
    _value: torch.Tensor | None
    _lock: threading.Lock

    @staticmethod
    def __new__(
        cls, thunk: Callable[[], torch.Tensor], shape: torch.Size, dtype: torch.dtype
    ) -> LazyLoss:
        t = make_wrapper_tensor(cls, shape, dtype)
        t._thunk, t._value = thunk, None
        t._lock = threading.Lock()
        return t

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # saved (a checkpoint's monitored metric) as the plain tensor it stands for
        return self.resolve().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.resolve().clone()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LazyLoss({self.resolve()!r})" if self.resolved else "LazyLoss(<pending>)"

    @property
    def resolved(self) -> bool:
        return self._value is not None

    def resolve(self) -> torch.Tensor:
        """The value (waits for the iteration on first use; its error is raised here)."""
        with self._lock:
            if self._value is None:
                assert self._thunk is not None
                value = self._thunk()
                if not isinstance(value, torch.Tensor) or value.shape != self.shape:
                    raise TypeError(
                        f"a lazily resolved forward_backward result must be a tensor of shape "
                        f"{tuple(self.shape)}, got {type(value).__name__}"
                        f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}; "
                        "pass blocking=True to forward_backward for this loss_fn"
                    )
                self._value = value.detach().to(self.dtype)
                self._thunk = None  # frees what the computation held
            return self._value

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        leaves: list[Any] = []
        _map((args, kwargs), leaves.append)
        lazy = [a for a in leaves if isinstance(a, LazyLoss) and not a.resolved]
        if lazy and not op_is_mutable(func):
            meta = _on_meta(func, args, kwargs)
            if isinstance(meta, torch.Tensor):

                def later() -> torch.Tensor:
                    return func(*_real(args), **_real(kwargs))

                return LazyLoss(later, meta.shape, meta.dtype)
        return func(*_real(args), **_real(kwargs))


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(x, fn) for x in tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return fn(tree)


def _real(tree: Any) -> Any:
    return _map(tree, lambda a: a.resolve() if isinstance(a, LazyLoss) else a)


def _on_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on shape-only copies of its tensors, or None when its output is not one
    CPU tensor (then the value is needed now)."""

    def to_meta(a: Any) -> Any:
        if isinstance(a, LazyLoss):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu" or a.requires_grad:
                raise _NotDeferrable
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        if isinstance(a, torch.device) and a.type != "cpu":
            raise _NotDeferrable
        return a

    try:
        out = func(*_map(args, to_meta), **_map(kwargs, to_meta))
    except Exception:  # noqa: BLE001 - not deferrable: compute it now
        return None
    return out if isinstance(out, torch.Tensor) and out.device.type == "meta" else None


class _NotDeferrable(Exception):
    pass


# hooks that read the window's gradients on the training thread: with overlapped
# iterations those gradients are only complete on the optimizer thread
_GRAD_HOOKS_MODULE = (
    "on_after_backward",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
)
_GRAD_HOOKS_CALLBACK = ("on_after_backward", "on_before_optimizer_step")


def overlap_blocker(trainer: Any, async_step: bool, has_scaler: bool) -> str | None:
    """Why this run cannot overlap its iterations (None if it can)."""
    lm = trainer.lightning_module
    if not async_step:
        return "async_step=False: each iteration computes with the weights of every step before it"
    if not lm.automatic_optimization:
        return "manual optimization reads the gradients in training_step"
    if has_scaler:
        return "16-mixed checks the window's gradients before the next window's loss scale is known"
    for name in _GRAD_HOOKS_MODULE:
        if is_overridden(name, lm):
            return f"{type(lm).__name__}.{name} reads the gradients on the training thread"
    for cb in trainer.callbacks:
        for name in _GRAD_HOOKS_CALLBACK:
            if getattr(type(cb), name) is not getattr(Callback, name):
                return f"callback {type(cb).__name__}.{name} reads the gradients on the training thread"
    return None


class OverlappedForwardBackward:
    """A ``RoundPipe.forward_backward_hook``: while ``active()`` holds, a call that did
    not choose ``blocking`` (nor ``return_outputs``) runs non-blocking and returns a
    :class:`LazyLoss`. The first runs blocking: its result gives the loss's shape and
    dtype (a loss_fn returning several losses keeps every call blocking)."""

    def __init__(self, active: Callable[[], bool], on_failure: Callable[[], None]) -> None:
        self.active, self.on_failure = active, on_failure
        self.meta: tuple[torch.Size, torch.dtype] | None = None
        self.seen = False
        # calls issued and maybe not finished: the training loop stays at most this
        # many calls ahead of the devices (enough to overlap, bounded memory)
        self.inflight: collections.deque[Any] = collections.deque()
        self.depth = 2

    def __call__(self, call: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        if not self.active() or kwargs["blocking"] is not None or kwargs["return_outputs"]:
            return call(**kwargs)  # as asked (outputs are not lazy)
        if not self.seen:
            self.seen = True
            out = call(**kwargs)
            if isinstance(out, torch.Tensor):
                self.meta = (out.shape, out.dtype)
            return out
        if self.meta is None:
            return call(**kwargs)
        while len(self.inflight) >= self.depth:
            self.inflight.popleft().wait()
        try:
            pending = call(**{**kwargs, "blocking": False})
        except BaseException:
            self.on_failure()  # an earlier iteration (or a step behind it) failed
            raise
        self.inflight.append(pending)

        def value() -> torch.Tensor:
            try:
                return pending.result()
            except BaseException:
                self.on_failure()
                raise

        return LazyLoss(value, *self.meta)
