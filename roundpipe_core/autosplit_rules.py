"""How the automatic split cuts a module tree into units: the size measures and their
thresholds, the modules kept on the host and those given their own run config, each
option of :func:`roundpipe_core.autosplit.auto_wrap` checked once.

:mod:`roundpipe_core.autosplit` walks the tree with these rules; nothing here runs a model.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from .config import RoundPipeRunConfig, check_run_config

__all__ = [
    "SplitRules",
    "default_threshold",
    "has_own_forward",
    "nbytes",
    "numel",
    "reads_child_weights",
    "split_rules",
]


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def nbytes(module: nn.Module, recurse: bool = True) -> int:
    """Bytes of the parameters and buffers (shared tensors once): the published
    RoundPipe's measure of a module's size for its thresholds."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters(recurse)) + list(module.buffers(recurse)):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def default_threshold(model: nn.Module) -> int:
    return max(1, numel(model) // 8)


def has_own_forward(m: nn.Module) -> bool:
    """Whether ``m`` has a forward of its own (a ModuleList, ModuleDict has not: its
    children are called by the parent's code, so it cannot run as one unit)."""
    return type(m).forward is not nn.Module.forward


# ``self.<child>.<attribute>`` in a forward's source, unless only its metadata is read
_CHILD_ATTRIBUTE = re.compile(
    r"self\.(\w+)\.(\w+)\b(?!\s*\.\s*(?:dtype|device|shape|ndim|requires_grad)\b)(?!\s+is\b)"
)


def reads_child_weights(m: nn.Module) -> bool:
    """Whether ``m``'s own ``forward`` (its source, as written) uses a parameter of a child
    directly -- ``F.conv1d(x, self.conv1d.weight)`` in Mamba's mixers -- instead of calling
    the child. Such a module is one unit, not opened: the child's weight would be used on
    the host outside the child's unit. Uses the scan cannot see (a helper method, a deeper
    path) are found while the model runs (``autosplit_calls.HostReads``)."""
    try:
        source = inspect.getsource(type(m).forward)
    except (OSError, TypeError):  # no source (built in, generated): nothing to read
        return False
    for child_name, attr in _CHILD_ATTRIBUTE.findall(source):
        child = m._modules.get(child_name)
        if child is not None and attr in child._parameters:
            return True
    return False


class SplitRules:
    """How the tree is cut into units: the size measure and its thresholds, the modules
    kept on the host, and the modules that take their own run config."""

    def __init__(
        self,
        threshold: int,
        size: Callable[[nn.Module], int] = numel,
        lower_threshold: int | None = None,
        skip_modules: Collection[nn.Module] = (),
        override_config: Mapping[nn.Module, RoundPipeRunConfig] | None = None,
    ) -> None:
        self.threshold, self.size, self.lower = threshold, size, lower_threshold
        self.skip = {id(m) for m in skip_modules}
        self.override = {id(m): c for m, c in (override_config or {}).items()}

    def holds_skipped(self, m: nn.Module) -> bool:
        return bool(self.skip) and any(id(x) in self.skip for x in m.modules())

    def whole(self, m: nn.Module) -> bool:
        """``m`` (holding no skipped module) becomes one unit without being opened."""
        if id(m) in self.override:
            return True
        # a module that holds big parameters itself cannot be cut below them
        own = nbytes(m, recurse=False)
        return self.lower is not None and own > 0 and own >= self.lower

    def config_of(
        self, m: nn.Module, default: RoundPipeRunConfig | None
    ) -> RoundPipeRunConfig | None:
        """The run config of unit ``m``: its override, else ``default``; a unit smaller than
        ``lower_threshold`` runs as one microbatch (too small to pipeline)."""
        if id(m) in self.override:
            return self.override[id(m)]
        if self.lower is not None and nbytes(m) < self.lower:
            base = default if default is not None else RoundPipeRunConfig()
            return replace(base, num_microbatch=1)
        return default


def _check_bytes(name: str, value: Any, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes or None, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} bytes, got {value}")


def split_rules(
    model: nn.Module,
    split_threshold: int | None,
    upper_threshold: int | None,
    lower_threshold: int | None,
    skip_modules: Collection[nn.Module],
    override_config: Mapping[nn.Module, RoundPipeRunConfig] | None,
) -> SplitRules:
    """The split rules from auto_wrap's arguments, each checked."""
    if split_threshold is not None and (
        isinstance(split_threshold, bool)
        or not isinstance(split_threshold, int)
        or split_threshold < 1
    ):
        raise ValueError(
            f"split_threshold must be a positive int (parameters), got {split_threshold!r}"
        )
    _check_bytes("upper_threshold", upper_threshold, 1)
    _check_bytes("lower_threshold", lower_threshold, 0)
    if split_threshold is not None and upper_threshold is not None:
        raise ValueError("give upper_threshold (bytes) or split_threshold (parameters), not both")
    if isinstance(skip_modules, nn.Module) or not all(
        isinstance(m, nn.Module) for m in skip_modules
    ):
        raise TypeError("skip_modules must be a collection of nn.Module, e.g. [model.head]")
    for m, cfg in (override_config or {}).items():
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"override_config keys must be submodules of the model, got {type(m).__name__}"
            )
        check_run_config(cfg, f"override_config[{type(m).__name__}]")
        if not has_own_forward(m):
            raise ValueError(
                f"override_config names a {type(m).__name__}, which has no forward of its own "
                "and cannot run as one unit; name its children instead"
            )
    inside = {id(x) for x in model.modules()}
    for what, mods in (
        ("skip_modules", list(skip_modules)),
        ("override_config", list(override_config or {})),
    ):
        for m in mods:
            if id(m) not in inside:
                raise ValueError(
                    f"{what} holds a {type(m).__name__} that is not a submodule of the model"
                )
    if upper_threshold is not None:
        return SplitRules(upper_threshold, nbytes, lower_threshold, skip_modules, override_config)
    threshold = split_threshold if split_threshold is not None else default_threshold(model)
    return SplitRules(threshold, numel, lower_threshold, skip_modules, override_config)
