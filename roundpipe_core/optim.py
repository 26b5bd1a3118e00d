"""CPU optimizers under the published RoundPipe's names, backed by torch's own.

RoundPipe runs the optimizer on the CPU over fp32 master weights. Each class here *is*
the torch optimizer of the same name (a subclass: same signature, defaults and
``state_dict``; works with LR schedulers and ``torch.amp.GradScaler``); the only change:
when the caller leaves ``fused`` / ``foreach`` unset, ``fused=True`` where torch has a
fused CPU kernel (Adam, AdamW, SGD, Adagrad) and every parameter is a floating-point
tensor on a device that kernel supports, else torch's default (its foreach path measured
slower than its per-tensor loop on CPU for all the others: ``benchmarks/optimizers.py``).
:func:`fused_variant` and :func:`use_fastest_` do the same for a plain torch optimizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices

__all__ = [
    "Adam",
    "AdamW",
    "SGD",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "Adafactor",
    "fastest_impl",
    "check_state_matches",
    "fused_variant",
    "use_fastest_",
    "why_not_faster",
]

# Which torch implementation runs by default, per optimizer (see the module docstring;
# --variants measured torch 2.13's foreach path at 0.5-0.95x the loop's speed on CPU).
# "foreach" stays available for an optimizer where that changes.
_IMPL: dict[str, str] = {
    "Adam": "fused",
    "AdamW": "fused",
    "SGD": "fused",
    "Adagrad": "fused",
    "Adadelta": "default",
    "Adamax": "default",
    "ASGD": "default",
    "NAdam": "default",
    "RAdam": "default",
    "RMSprop": "default",
    "Rprop": "default",
    "Adafactor": "default",
}


def fastest_impl(name: str) -> str:
    """``"fused"``, ``"foreach"`` or ``"default"``: what this module runs for optimizer ``name``."""
    if name not in _IMPL:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(_IMPL)}")
    return _IMPL[name]


def _param_tensors(params: list[Any]) -> list[torch.Tensor]:
    """The tensors of a params list in any of torch's forms (tensors, named, groups)."""
    out: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, dict):
            out.extend(_param_tensors(list(p["params"])) if "params" in p else [])
        elif isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            out.append(p[1])
        elif isinstance(p, torch.Tensor):
            out.append(p)
    return out


def _foreach_ok(tensors: list[torch.Tensor]) -> bool:
    return bool(tensors) and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_sparse for t in tensors
    )


def _fused_ok(tensors: list[torch.Tensor]) -> bool:
    devices = _get_fused_kernels_supported_devices()
    return _foreach_ok(tensors) and all(
        t.device.type in devices and torch.is_floating_point(t) for t in tensors
    )


def _faster_impl(
    name: str, settings: Sequence[dict[str, Any]], tensors: list[torch.Tensor]
) -> tuple[str | None, str]:
    """``("fused" | "foreach", "")`` to switch on for optimizer ``name`` with these
    arguments / param groups, or ``(None, why not)``."""
    if any(s.get("fused") is not None or s.get("foreach") is not None for s in settings):
        return None, "it was built with an explicit fused=/foreach= choice, which is kept"
    if any(s.get("differentiable") or s.get("capturable") for s in settings):
        return None, "it was built with differentiable=True or capturable=True"
    impl = _IMPL.get(name, "default")
    fits = {"fused": _fused_ok, "foreach": _foreach_ok}.get(impl)
    if fits is None:
        return None, f"torch has no fused CPU kernel for {name}"
    if not fits(tensors):
        return None, "some of its parameters are not dense floating-point tensors it takes"
    return impl, ""


class _FastestByDefault:
    """Mixin: fill ``fused`` / ``foreach`` with this module's choice when left unset."""

    _torch_cls: type[torch.optim.Optimizer]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        base = next(b for b in cls.__mro__[1:] if b.__module__.startswith("torch.optim"))
        cls._torch_cls = base
        cls.__signature__ = inspect.signature(base)  # type: ignore[attr-defined]
        cls.__doc__ = (
            f"``torch.optim.{base.__name__}`` running torch's fastest CPU implementation "
            f"({fastest_impl(base.__name__)}) unless ``fused``/``foreach`` are given.\n\n"
            f"Same arguments and defaults as ``torch.optim.{base.__name__}``."
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        sig = inspect.signature(self._torch_cls)
        bound = sig.bind(*args, **kwargs)
        params = bound.arguments["params"]
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or "
                f"dicts, but got {torch.typename(params)}"
            )
        params = list(params) if isinstance(params, Iterable) else params
        bound.arguments["params"] = params
        impl, _ = _faster_impl(self._torch_cls.__name__, [bound.arguments], _param_tensors(params))
        if impl is not None:
            bound.arguments[impl] = True
        super().__init__(*bound.args, **bound.kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, then :func:`check_state_matches`: the fused
        kernel this class runs by default would not notice a state of other shapes."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        check_state_matches(self)  # type: ignore[arg-type]


class Adam(_FastestByDefault, torch.optim.Adam):
    pass


class AdamW(_FastestByDefault, torch.optim.AdamW):
    pass


class SGD(_FastestByDefault, torch.optim.SGD):
    pass


class Adagrad(_FastestByDefault, torch.optim.Adagrad):
    pass


class Adadelta(_FastestByDefault, torch.optim.Adadelta):
    pass


class Adamax(_FastestByDefault, torch.optim.Adamax):
    pass


class ASGD(_FastestByDefault, torch.optim.ASGD):
    pass


class NAdam(_FastestByDefault, torch.optim.NAdam):
    pass


class RAdam(_FastestByDefault, torch.optim.RAdam):
    pass


class RMSprop(_FastestByDefault, torch.optim.RMSprop):
    pass


class Rprop(_FastestByDefault, torch.optim.Rprop):
    pass


class Adafactor(_FastestByDefault, torch.optim.Adafactor):
    pass


_OURS: dict[str, type[Any]] = {c.__name__: c for c in _FastestByDefault.__subclasses__()}


# --------------------------------------------------------------------------- user optimizers
def _upgrade(optimizer: torch.optim.Optimizer) -> tuple[str, str | None, str]:
    """(torch class name, implementation to switch ``optimizer`` to or None, why not)."""
    torch_cls = next(
        (c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")), None
    )
    if torch_cls is None:
        return "", None, "it is not a torch.optim optimizer"
    name = torch_cls.__name__
    if type(optimizer) not in (torch_cls, _OURS.get(name)):
        return name, None, f"it is a subclass of {name} that may rely on its own step()"
    groups = optimizer.param_groups
    return (name, *_faster_impl(name, groups, [p for g in groups for p in g["params"]]))


def why_not_faster(optimizer: torch.optim.Optimizer) -> str:
    """Why :func:`use_fastest_` leaves ``optimizer`` as it is ("" where it switches it)."""
    return _upgrade(optimizer)[2]


def _fused_steps(optimizer: torch.optim.Optimizer) -> dict[Any, dict[str, Any]]:
    """State with ``step`` as the fp32 tensor on the parameter's device that fused kernels read."""
    state: dict[Any, dict[str, Any]] = {}
    for p, s in optimizer.state.items():
        s = dict(s)
        if "step" in s:
            s["step"] = torch.as_tensor(s["step"], dtype=torch.float32, device=p.device)
        state[p] = s
    return state


def fused_variant(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The fastest equivalent of a plain torch optimizer, on the same parameters and state.

    Args:
        optimizer: a ``torch.optim`` optimizer (or one of this module's) built without
            choosing ``fused`` / ``foreach``.

    Returns:
        A new optimizer of this module's class with the same parameter groups and
        hyper-parameters, running the fused (or foreach) implementation, whose state
        holds the same tensors (no copy) -- or ``None`` when there is nothing faster:
        an optimizer without a faster CPU path here, one already fused/foreach or whose
        caller chose an implementation, a subclass with its own ``step``, or parameters
        the fast path does not take (non-float, sparse, unsupported device).
    """
    name, impl, _ = _upgrade(optimizer)
    if impl is None:
        return None
    new = _OURS[name]([{**g, impl: True} for g in optimizer.param_groups])
    for k, v in optimizer.defaults.items():
        new.defaults.setdefault(k, v)
    new.state.update(_fused_steps(optimizer) if impl == "fused" else optimizer.state)
    return new


def use_fastest_(optimizer: torch.optim.Optimizer) -> bool:
    """Switch ``optimizer`` in place to the implementation :func:`fused_variant` would use
    (the object stays the same, so LR schedulers and references to it keep working).

    Returns:
        Whether it was switched (``False`` in every case :func:`fused_variant` returns None).
    """
    _, key, _ = _upgrade(optimizer)
    if key is None:
        return False
    if key == "fused":
        for p, s in _fused_steps(optimizer).items():
            optimizer.state[p] = s
        # fused kernels unscale inside the step when torch.amp.GradScaler asks them to
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    optimizer.defaults[key] = True
    for g in optimizer.param_groups:
        g[key] = True
    return True


def check_state_matches(
    optimizer: torch.optim.Optimizer, names: dict[int, str] | None = None
) -> None:
    """Raise if a per-parameter state tensor (``exp_avg``, ...) does not have its
    parameter's shape: torch's fused kernels do not check, and a state loaded for other
    parameters trains to NaN or corrupts memory. Scalar entries are not compared.

    Args:
        optimizer: the optimizer whose ``state`` to check.
        names: parameter id -> name, for the message (else its group and position).

    Raises:
        ValueError: naming the parameter, the state entry and both shapes.
    """
    names = names or {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                if value.shape != p.shape:
                    where = names.get(id(p), f"param_groups[{gi}]['params'][{pi}]")
                    raise ValueError(
                        f"{type(optimizer).__name__} state {key!r} of parameter {where!r} has "
                        f"shape {tuple(value.shape)} but the parameter has {tuple(p.shape)}: "
                        "the optimizer state was made for other parameters (a checkpoint "
                        "saved while the optimizer listed its parameters in another order, "
                        "or with other shapes). Build the optimizer over the same parameters, "
                        "in the same order, as the run that saved the state."
                    )
