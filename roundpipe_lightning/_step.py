"""An optimizer step queued on RoundPipe's optimizer thread, with the hyperparameters
it was queued with.

With ``async_step=True`` the strategy's ``optimizer_step`` returns before
``optimizer.step()`` has run, and Lightning then steps the LR schedulers on the
main thread. Reading ``param_groups`` on the optimizer thread would race with
that write and pick up the *next* step's learning rate. So the param groups are
copied when the step is queued, and the queued step runs on a *twin* of the
optimizer: an instance of the same class that shares everything with the
user's optimizer (state, hooks, defaults) except ``param_groups``, which is the
copy. The user's object is not touched: its class and its groups stay its own,
and the schedulers, ``LearningRateMonitor`` and checkpoints keep seeing the live
groups. What the step writes into its groups or rebinds on the twin (step
counters of some optimizers) is carried back afterwards.

A ``step`` set on the instance is honoured: an LR scheduler's wrapper (it only
marks the step as called, which the strategy does when the step is
queued) gives way to the class's ``step``; a method bound to the optimizer is
bound to the twin instead. Any other callable (user code wrapping the live
optimizer's ``step``) cannot be moved to the twin: it runs on the user's
optimizer with its live groups, with a warning that a scheduler's next value may
be seen.
"""

from __future__ import annotations

import collections
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer

from roundpipe_core.stepping.layerwise import step_subset, steps_elementwise

from ._private import is_lr_scheduler_step_wrapper, make_wrapper_tensor, op_is_mutable

__all__ = [
    "QueuedStep",
    "LazyLoss",
    "OverlappedForwardBackward",
    "overlap_blocker",
    "in_order",
    "steps_in_parts",
]

_MISSING = object()

#: instance attributes a twin does not take over: its own groups, and the LR scheduler's
#: per-instance ``step`` wrapper (bound to the user's object, it would step that one)
_NOT_SHARED = ("param_groups", "step")


#: optimizers already warned about an instance-level step that reads the live groups
_WARNED: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def _own_step(optimizer: Optimizer) -> Any:
    """``step`` set on the instance, or None (the class's, or an LR scheduler's wrapper
    that only marks the call)."""
    own = vars(optimizer).get("step")
    if own is None or is_lr_scheduler_step_wrapper(own):
        return None
    return own


def _frozen(value: Any) -> Any:
    # schedulers update tensor learning rates in place (``lr.fill_``)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class QueuedStep:
    """``optimizer.step(**kwargs)`` with the hyperparameters the param groups hold now.

    Create it on the main thread when the step is queued; call :meth:`run` on the
    optimizer thread.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        live = optimizer.param_groups
        self.hyper = [{k: _frozen(v) for k, v in g.items() if k != "params"} for g in live]
        self.groups = [{**h, "params": g["params"]} for h, g in zip(self.hyper, live)]
        self.live = list(live)

    def _twin(self, own_step: types.MethodType | None) -> tuple[Optimizer, dict[str, Any]]:
        """A same-class optimizer sharing the user's state and hooks, with this step's
        groups (and ``own_step``, a method of the user's optimizer, bound to it); and
        the attributes it started with (to see what the step rebinds)."""
        opt = self.optimizer
        shared = {k: v for k, v in vars(opt).items() if k not in _NOT_SHARED}
        twin = object.__new__(type(opt))
        vars(twin).update(shared)
        vars(twin)["param_groups"] = self.groups
        if own_step is not None:
            vars(twin)["step"] = types.MethodType(own_step.__func__, twin)
        return twin, shared

    def run(self, params: Sequence[Tensor] | None = None, **kwargs: Any) -> Any:
        """The step, over ``params`` only if given (a layer-wise step's part)."""
        own = _own_step(self.optimizer)
        bound = isinstance(own, types.MethodType) and own.__self__ is self.optimizer
        if own is not None and not bound:
            return self._run_live(params, **kwargs)
        twin, before = self._twin(own)
        out = twin.step(**kwargs) if params is None else step_subset(twin, params, **kwargs)
        # attributes the step rebound on the twin (counters kept outside the groups)
        target = vars(self.optimizer)
        for key, value in vars(twin).items():
            if key not in _NOT_SHARED and before.get(key, _MISSING) is not value:
                target[key] = value
        # entries the step wrote into its groups (step counters of some optimizers)
        for h, g, live in zip(self.hyper, self.groups, self.live):
            for key, value in g.items():
                if key != "params" and (key not in h or h[key] is not value):
                    live[key] = value
        return out

    def _run_live(self, params: Sequence[Tensor] | None, **kwargs: Any) -> Any:
        """A user's ``step`` wrapper on the instance: it reads the live groups."""
        opt = self.optimizer
        if opt not in _WARNED:
            _WARNED.add(opt)
            warnings.warn(
                f"{type(opt).__name__}.step was replaced on the instance; with "
                "RoundPipeStrategy(async_step=True) it runs on the optimizer thread and reads "
                "the live param_groups, so a hyperparameter an LR scheduler sets for the next "
                "step may already be seen. Override step in a subclass instead.",
                RuntimeWarning,
                stacklevel=2,
            )
        return opt.step(**kwargs) if params is None else step_subset(opt, params, **kwargs)


def steps_in_parts(optimizer: Optimizer, module: pl.LightningModule) -> bool:
    """Whether an overlapped iteration's queued step may run parameter by parameter as
    the gradients complete (``RoundPipe.step_layerwise``) with the result of one step:
    an elementwise torch optimizer and no gradient clipping (the global norm needs every
    gradient before the first parameter is updated)."""
    if module.trainer.gradient_clip_val or is_overridden(
        "configure_gradient_clipping", module, pl.LightningModule
    ):
        return False
    return steps_elementwise(optimizer)


def in_order(*fns: Callable[[], Any]) -> Callable[[], None]:
    """One callable running ``fns`` one after the other."""

    def run() -> None:
        for fn in fns:
            fn()

    return run


class LazyLoss(torch.Tensor):
    """A loss whose value is computed later: the result of a non-blocking
    ``forward_backward`` seen as a tensor.

    Pure tensor operations on it (``detach``, ``clone``, arithmetic, dtype casts -- what
    ``self.log`` and Lightning's loop do with a loss) return further lazy tensors and
    wait for nothing. Anything that needs the number -- ``float()``, ``.item()``,
    printing, a comparison, an in-place write into another tensor -- waits for the
    iteration and computes it once. Shape and dtype are known up front (``shape``,
    ``dtype``); the value is checked against them when it arrives.
    """

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
        """Whether the value has been computed."""
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
        lazy = [a for a in _flat((args, kwargs)) if isinstance(a, LazyLoss) and not a.resolved]
        if lazy and not op_is_mutable(func):
            meta = _on_meta(func, args, kwargs)
            if isinstance(meta, torch.Tensor):

                def later() -> torch.Tensor:
                    return func(*_real(args), **_real(kwargs))

                return LazyLoss(later, meta.shape, meta.dtype)
        return func(*_real(args), **_real(kwargs))


def _flat(tree: Any) -> list[Any]:
    if isinstance(tree, (list, tuple)):
        return [x for item in tree for x in _flat(item)]
    if isinstance(tree, dict):
        return [x for item in tree.values() for x in _flat(item)]
    return [tree]


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(x, fn) for x in tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return fn(tree)


def _real(tree: Any) -> Any:
    return _map(tree, lambda a: a.resolve() if isinstance(a, LazyLoss) else a)


def _on_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on shape-only copies of its tensors: the output's shape and dtype, or
    None when that is not a single tensor computed on CPU (then the value is needed now)."""

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


def overlap_blocker(
    trainer: Any, async_step: bool, world_size: int, has_scaler: bool, grad_hooks: bool
) -> str | None:
    """Why this run cannot overlap its iterations (None if it can)."""
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden

    lm = trainer.lightning_module
    if not async_step:
        return "async_step=False: each iteration computes with the weights of every step before it"
    if not lm.automatic_optimization:
        return "manual optimization reads the gradients in training_step"
    if world_size > 1:
        return "the gradients are reduced over processes on the training thread"
    if has_scaler:
        return "16-mixed checks the window's gradients before the next window's loss scale is known"
    if grad_hooks:
        return "gradient hooks are registered on the RoundPipe"
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
    not choose ``blocking`` runs non-blocking and returns the loss as a :class:`LazyLoss`.

    An explicit ``blocking=...`` and ``return_outputs=True`` (outputs are not lazy) run
    as asked. The first call runs blocking: its result gives the loss's shape and dtype
    (a loss_fn returning several losses keeps every call blocking).
    """

    def __init__(
        self,
        active: Callable[[], bool],
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
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
