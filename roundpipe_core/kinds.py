"""The engine's small vocabularies as ``str`` Enums, validated in one place, and the one
checker of its plain arguments (counts, flags). Each member *is* its text
(``RunType.FUSED == "fused"``): a user may pass the string, and logs print it.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = [
    "JobKind",
    "PinMode",
    "RecomputeGrain",
    "RunType",
    "check_byte_counts",
    "check_flag",
    "check_int",
    "parse_kind",
]


class _Text(str, Enum):
    """A str Enum that prints as its text."""

    def __str__(self) -> str:
        return self.value


class RunType(_Text):
    """What a pipelined call computes.

    ``INFER``: forward only. ``TRAIN``: forward now, backward later through
    autograd (``forward()`` under grad mode). ``FUSED``: ``forward_backward()``,
    whose first backward stage also runs the forward of its layers and the loss.
    """

    INFER = "infer"
    TRAIN = "train"
    FUSED = "fused"


class JobKind(_Text):
    """What one job of a schedule does with its stage. The one-letter ``code`` is
    the text form of a job (``"2F0"``: stage 2, forward, device 0)."""

    FORWARD = "forward"
    FUSED = "fused"
    BACKWARD = "backward"

    @property
    def code(self) -> str:
        return {"forward": "F", "fused": "X", "backward": "B"}[self.value]

    @classmethod
    def from_code(cls, code: str) -> JobKind:
        for kind in cls:
            if kind.code == code:
                return kind
        raise ValueError(f"unknown job kind code {code!r}; expected one of F, X, B")


class RecomputeGrain(_Text):
    """How a backward stage recomputes: the whole stage then its backward
    (``STAGE``), or one layer at a time (``LAYER``: less activation memory)."""

    STAGE = "stage"
    LAYER = "layer"


class PinMode(_Text):
    """Host memory of the model's parameters on CUDA: pinned copies (``ALLOC``),
    the existing storage pinned in place (``REGISTER``), or pageable (``OFF``)."""

    ALLOC = "alloc"
    REGISTER = "register"
    OFF = "off"


_E = TypeVar("_E", bound=Enum)


def parse_kind(enum: type[_E], value: object, name: str) -> _E:
    """``value`` (a member or its text) as a member of ``enum``; ValueError naming the
    argument ``name``, the bad value and the choices."""
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        for member in enum:
            if member.value == value:
                return member
    choices = ", ".join(repr(m.value) for m in enum)
    raise ValueError(f"{name} must be one of {choices}; got {value!r}")


def check_int(value: object, name: str, minimum: int = 1, why: str = "") -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; ValueError naming
    the argument ``name``, the bound, what the number counts (``why``) and the bad value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        counts = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an int >= {minimum}{counts}, got {value!r}")
    return value


def check_byte_counts(value: object, name: str, count: int | None = None) -> list[float]:
    """``value`` as floats if it is a list or tuple of numbers >= 0 (``count`` of them
    where given); ValueError naming the argument ``name`` and the bad value."""
    items = list(value) if isinstance(value, (list, tuple)) else None
    if (
        items is None
        or (count is not None and len(items) != count)
        or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and b >= 0 for b in items
        )
    ):
        per = "one per layer" if count is None else f"one per layer ({count})"
        raise ValueError(f"{name} must be a list of byte counts >= 0, {per}, got {value!r}")
    return [float(b) for b in items]


def check_flag(value: object, name: str, none: str = "") -> bool | None:
    """``value`` if it is True or False, or None where ``none`` says what None means;
    TypeError naming the argument ``name``, the choices and the bad value."""
    if isinstance(value, bool) or (none and value is None):
        return value
    choices = f"True, False or None ({none})" if none else "True or False"
    raise TypeError(f"{name} must be {choices}, got {value!r}")
