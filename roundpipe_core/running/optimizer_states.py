"""How many parameter-sized state tensors an optimizer keeps per parameter: the
optimizer-state line of the host-memory budget (``host_memory.py``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OPTIMIZER_STATES", "UnknownOptimizerError", "optimizer_states_per_param"]

#: Parameter-sized state tensors each optimizer keeps (torch.optim defaults; the scalar
#: ``step`` counters are negligible). Options that add states are handled by
#: :func:`optimizer_states_per_param`.
OPTIMIZER_STATES: dict[str, int] = {
    "adam": 2,
    "adamw": 2,
    "adamax": 2,
    "nadam": 2,
    "radam": 2,
    "sparseadam": 2,
    "adadelta": 2,
    "rprop": 2,
    "adagrad": 1,
    "asgd": 1,
    "rmsprop": 1,
    "sgd": 0,
}


class UnknownOptimizerError(ValueError):
    """The state table does not know this optimizer (pass ``optimizer_states``)."""


def optimizer_states_per_param(optimizer: Any) -> int:
    """Parameter-sized state tensors ``optimizer`` keeps per parameter.

    Args:
        optimizer: a ``torch.optim.Optimizer`` instance (its options are read: SGD
            ``momentum``, Adam ``amsgrad``, RMSprop ``momentum``/``centered``), an
            optimizer class, or a name such as ``"adamw"`` or ``"sgd"``.

    Raises:
        UnknownOptimizerError: (a ``ValueError``) for an optimizer this table does not
            know, nor any of its base classes (pass ``optimizer_states=N`` to
            :func:`estimate_host_memory` instead).
        TypeError: for anything else.
    """
    defaults: dict[str, Any] = {}
    if isinstance(optimizer, torch.optim.Optimizer):
        name = _known_name(type(optimizer))
        groups = optimizer.param_groups or [optimizer.defaults]
        defaults = {
            k: any(bool(g.get(k)) for g in groups) for k in ("momentum", "amsgrad", "centered")
        }
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = _known_name(optimizer)
    elif isinstance(optimizer, str):
        name = optimizer
    else:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, its class or a name such as 'adamw', "
            f"got {type(optimizer).__name__}"
        )
    key = _key(name)
    if key not in OPTIMIZER_STATES:
        raise UnknownOptimizerError(
            f"no state count known for optimizer {name!r} (known: {', '.join(sorted(OPTIMIZER_STATES))}); "
            "pass optimizer_states=<parameter-sized tensors it keeps per parameter>"
        )
    n = OPTIMIZER_STATES[key]
    if key == "sgd" and defaults.get("momentum"):
        n += 1
    if key in ("adam", "adamw") and defaults.get("amsgrad"):
        n += 1
    if key == "rmsprop":
        n += int(bool(defaults.get("momentum"))) + int(bool(defaults.get("centered")))
    return n


def _key(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _known_name(cls: type) -> str:
    """The name of the first class in ``cls``'s MRO this table knows (a subclass of
    ``torch.optim.SGD`` keeps SGD's state), else ``cls``'s own name."""
    for base in cls.__mro__:
        if _key(base.__name__) in OPTIMIZER_STATES:
            return base.__name__
    return cls.__name__


def optimizer_name(optimizer: Any) -> str:
    if isinstance(optimizer, str):
        return optimizer
    if isinstance(optimizer, type):
        return optimizer.__name__
    return type(optimizer).__name__
