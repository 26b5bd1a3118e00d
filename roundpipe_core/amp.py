"""Loss scaling for fp16 training with RoundPipe's asynchronous optimizer thread.

:class:`GradScaler` is a drop-in for ``torch.amp.GradScaler`` (same arguments, methods
and state dict; the arithmetic is a ``torch.amp.GradScaler("cpu")``'s) that keeps
torch's scale sequence whatever the thread timing (docs/differences.md, "GradScaler"):
``scale()`` runs in the loss function on worker threads, ``step()`` inside
``rp.step(step_fn)`` on the optimizer thread, and an ``update()`` the training thread
calls before this iteration's ``step()`` has run is *deferred* until it has; until
then ``scale()``, ``get_scale()`` and ``state_dict()`` wait for it (a timeout turns a
forgotten ``step()`` into an error).

Usage (the published RoundPipe's pattern)::

    scaler = GradScaler()
    for x, y in data:
        rp.forward_backward(input_args=(x,), label=y,
                            loss_fn=lambda out, lbl: scaler.scale(criterion(out, lbl)))
        rp.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()

With several optimizers, "this iteration's step" means a ``step()`` of every optimizer
the scaler has stepped before; in the first iteration call ``rp.synchronize()`` before
``update()`` (or step them all before the first ``update()``). ``update()`` inside
``step_fn`` is exact only with a synchronous step (``rp.step(fn, is_async=False)``).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections import abc
from typing import Any, overload

import torch

from .kinds import check_flag

__all__ = ["GradScaler"]


_SCALER_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "enabled": True,
}


def _scaler_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """GradScaler's arguments in this class's order or in torch's (device first)."""
    device = kwargs.pop("device", None)
    if args and isinstance(args[0], (str, torch.device)):
        if device is not None:
            raise TypeError("GradScaler got the device twice (first argument and device=)")
        device, args = args[0], args[1:]
    if device is not None:
        torch.device(device)  # a device torch can name (RuntimeError otherwise)
    names = list(_SCALER_DEFAULTS)
    if len(args) > len(names):
        raise TypeError(f"GradScaler takes at most {len(names)} arguments after the device")
    values = dict(_SCALER_DEFAULTS, **dict(zip(names, args)))
    for name, value in kwargs.items():
        if name not in values:
            raise TypeError(f"GradScaler got an unexpected keyword argument {name!r}")
        if name in names[: len(args)]:
            raise TypeError(f"GradScaler got multiple values for {name!r}")
        values[name] = value
    return values


class GradScaler:
    """Gradient scaler for mixed precision, safe across RoundPipe's threads.

    Args:
        init_scale: initial scale factor.
        growth_factor: factor the scale is multiplied by after ``growth_interval``
            consecutive iterations without inf/NaN gradients.
        backoff_factor: factor the scale is multiplied by after an iteration with
            inf/NaN gradients (whose optimizer step is skipped).
        growth_interval: iterations without inf/NaN before the scale grows.
        enabled: ``False`` makes ``step`` a plain ``optimizer.step()``, the rest no-ops.
        wait_timeout: seconds a call waits for a deferred ``update()`` to find its
            ``step()`` before raising ``RuntimeError``.

    ``torch.amp.GradScaler``'s signature is accepted too (``GradScaler("cuda", 1024.0)``,
    ``GradScaler(device="cpu", init_scale=8.0)``); the scale lives with the masters on
    the CPU whatever device it names.
    """

    def __init__(self, *args: Any, wait_timeout: float = 300.0, **kwargs: Any) -> None:
        values = _scaler_arguments(args, kwargs)
        growth_interval = values["growth_interval"]
        if not isinstance(growth_interval, int) or isinstance(growth_interval, bool):
            raise TypeError(f"growth_interval must be an int, got {growth_interval!r}")
        if wait_timeout <= 0:
            raise ValueError(f"wait_timeout must be positive seconds, got {wait_timeout!r}")
        self._impl = torch.amp.GradScaler("cpu", **values)
        if self._impl.is_enabled():
            # the scale lives with the fp32 masters on the CPU; scale() copies it to the
            # loss's device
            self._impl._lazy_init_scale_growth_tracker(torch.device("cpu"))
        # _step_lock serialises the optimizer side (torch's per-optimizer bookkeeping) and is
        # held while an optimizer steps; _cond guards the scale and the deferred update and
        # is never held during a step, so scale()/update() do not wait for one. Order:
        # _step_lock before _cond.
        self._step_lock = threading.RLock()
        self._cond = threading.Condition()
        self._timeout = float(wait_timeout)
        self._pending = False  # an update() waiting for this iteration's step()
        self._pending_scale: float | torch.Tensor | None = None
        self._stepped: set[int] = set()  # ids of optimizers stepped since the last update
        self._known: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    # -- scaling ---------------------------------------------------------------------
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: abc.Iterable[torch.Tensor]) -> abc.Iterable[torch.Tensor]: ...

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor (or an iterable of tensors) by the current scale (unchanged
        when disabled). Safe from any thread; waits while an ``update()`` is deferred."""
        if not self.is_enabled():
            return outputs
        with self._cond:
            self._wait_resolved("scale()")
            assert self._impl._scale is not None  # set by the first scale() of an enabled scaler
            s = self._impl._scale.clone()  # a snapshot: a later update cannot touch the graph
        return _apply_scale(outputs, s)

    # -- the optimizer side ---------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and check them for inf/NaN, as
        torch does (optional; ``step`` does it)."""
        if not self.is_enabled():
            return
        with self._step_lock:
            self._impl.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` ran) and run ``optimizer.step(*args, **kwargs)``
        unless the gradients hold inf/NaN.

        Returns:
            ``optimizer.step``'s return value, or ``None`` when the step was skipped.
        """
        if not self.is_enabled():
            return optimizer.step(*args, **kwargs)
        with self._step_lock:
            retval = self._impl.step(optimizer, *args, **kwargs)
            with self._cond:
                self._stepped.add(id(optimizer))
                self._known.add(optimizer)
                if self._pending and self._all_known_stepped():
                    self._resolve(self._pending_scale)
            return retval

    # -- the training-thread side -------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None, is_async: bool = True) -> None:
        """Update the scale for the next iteration (torch's rule: back off after an
        iteration with inf/NaN, grow after ``growth_interval`` clean ones); deferred
        until this iteration's ``step()`` has run (see the module docs).

        Args:
            new_scale: set this scale instead of the automatic rule.
            is_async: ``True`` (default): return at once, a deferred update completing
                on the optimizer thread. ``False``: return once the update is done (as
                the published RoundPipe's), e.g. to read the scale or checkpoint.

        Raises:
            TypeError: ``is_async`` is not a bool.
            RuntimeError: ``is_async=False`` waited ``wait_timeout`` seconds and no
                ``scaler.step(optimizer)`` came (a forgotten step; never a hang).
        """
        check_flag(is_async, "is_async")
        if not self.is_enabled():
            return
        with self._cond:
            self._wait_resolved("update()")
            done = bool(self._stepped) and self._all_known_stepped()
            if not done and not (new_scale is not None and not self._known):
                # this iteration's step() has not run yet: it completes the update
                self._pending, self._pending_scale = True, new_scale
                if not is_async:
                    self._wait_resolved("update(is_async=False)")
                return
        with self._step_lock, self._cond:
            self._resolve(new_scale)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); waits for a deferred update."""
        if not self.is_enabled():
            return 1.0
        with self._cond:
            self._wait_resolved("get_scale()")
            return self._impl.get_scale()

    def is_enabled(self) -> bool:
        return self._impl.is_enabled()

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        """The growth factor (``up_to_date`` is accepted for the published signature)."""
        with self._cond:
            return self._impl.get_growth_factor()

    def set_growth_factor(self, new_factor: float) -> None:
        with self._step_lock, self._cond:
            self._impl.set_growth_factor(new_factor)

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        with self._cond:
            return self._impl.get_backoff_factor()

    def set_backoff_factor(self, new_factor: float) -> None:
        with self._step_lock, self._cond:
            self._impl.set_backoff_factor(new_factor)

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        with self._cond:
            return self._impl.get_growth_interval()

    def set_growth_interval(self, new_interval: int) -> None:
        with self._step_lock, self._cond:
            self._impl.set_growth_interval(new_interval)

    def state_dict(self) -> dict[str, Any]:
        """``torch.amp.GradScaler``'s state dict (same keys; loadable by either)."""
        with self._cond:
            self._wait_resolved("state_dict()")
            return self._impl.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this class or by ``torch.amp.GradScaler``."""
        with self._cond:
            self._wait_resolved("load_state_dict()")
        with self._step_lock, self._cond:
            self._impl.load_state_dict(state_dict)

    # -- internals ----------------------------------------------------------------------
    def _all_known_stepped(self) -> bool:
        # an iteration is complete once every optimizer this scaler steps has stepped
        return all(id(opt) in self._stepped for opt in self._known)

    def _resolve(self, new_scale: float | torch.Tensor | None) -> None:
        """torch's update() with this iteration's inf checks (caller holds both locks)."""
        self._impl.update(new_scale)
        self._pending, self._pending_scale = False, None
        self._stepped.clear()
        self._cond.notify_all()

    def _wait_resolved(self, what: str) -> None:
        if not self._pending:
            return
        if not self._cond.wait_for(lambda: not self._pending, timeout=self._timeout):
            raise RuntimeError(
                f"GradScaler.{what} waited {self._timeout:g}s for the deferred update(): "
                "update() was called before scaler.step(optimizer) of this iteration and no "
                "step came. Call scaler.step(optimizer) (e.g. inside rp.step's step_fn) "
                "before the next scale()."
            )


def _apply_scale(outputs: Any, scale: torch.Tensor) -> Any:
    cache: dict[torch.device, torch.Tensor] = {}

    def apply(val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            if val.device not in cache:
                cache[val.device] = scale.to(device=val.device, non_blocking=True)
            return val * cache[val.device]
        if isinstance(val, abc.Iterable):
            mapped = map(apply, val)
            return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    return apply(outputs)


# The published signature (positional order init_scale, growth_factor, ...) for
# inspect.signature and help(); __init__ takes *args so that torch's order -- a device
# first -- works as well (see the class docstring).
GradScaler.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in _SCALER_DEFAULTS.items()
    ]
    + [
        inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("wait_timeout", inspect.Parameter.KEYWORD_ONLY, default=300.0),
    ]
)
