"""Layout specs: stage sizes (and owner devices) per stage, as text or Python values
(the forms: :data:`LayoutSpec`, docs/layouts-and-planner.md "Layout strings").

:func:`parse_layout` reads one side, :func:`resolve_layout` turns both into stage
ranges and owners, :func:`format_layout` writes one side back. Numbers in text are ASCII
digits with an optional ``-`` and no leading zeros (``"01"``, ``"²"`` are likelier typos).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Union

from ..kinds import RunType, check_int, parse_kind

__all__ = [
    "LayoutSpec",
    "ParsedLayout",
    "check_num_devices",
    "format_layout",
    "parse_int",
    "parse_layout",
    "parse_layout_string",
    "resolve_layout",
]

#: A layout spec: ``"7,5"``, ``"0:4,0:3"``, ``[7, 5]``, ``[(0, 4), (0, 3)]``, ``[range(0, 7), ...]``
#: (counts round-robin, ``device:count`` per stage, full ranges), or ``""`` / ``[]``: no stages.
LayoutSpec = Union[str, int, Sequence[Any]]


@dataclass
class ParsedLayout:
    """One side of a layout (``name`` and ``items`` as given, for messages): exactly one
    of ``counts`` / ``ranges`` is set; ``owners`` per stage, ``None`` = round-robin."""

    name: str
    items: list[str]
    counts: list[int] | None
    ranges: list[range] | None
    owners: list[int] | None

    def describe(self) -> str:
        """Short text for messages: ``"7+5"`` or ``"0-6, 7-11"``."""
        if self.counts is not None:
            return "+".join(str(c) for c in self.counts) or "nothing"
        return ", ".join(f"{r.start}-{r.stop - 1}" for r in self.ranges or []) or "nothing"

    def num_layers_covered(self) -> int:
        """Layers the counts add up to, or the end of the deepest range."""
        if self.counts is not None:
            return sum(self.counts)
        return max((r.stop for r in self.ranges or []), default=0)


def parse_int(value: Any, what: str) -> int:
    """An int from an int or a ``-?[0-9]+`` string without leading zeros, else
    ``ValueError`` naming ``what``."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text.startswith("-") else text
        if digits.isascii() and digits.isdigit():
            if len(digits) > 1 and digits[0] == "0":
                raise ValueError(f"{what} is {value!r}: write {int(text)} without leading zeros")
            return int(text)
        raise ValueError(f"{what} must be an integer written with the digits 0-9, got {value!r}")
    raise ValueError(f"{what} must be an integer, got {value!r}")


def parse_layout(spec: LayoutSpec, name: str = "layout") -> ParsedLayout:
    """Parse one side of a layout (the module docstring's forms, or an int: one stage).

    Raises:
        TypeError: ``spec`` is none of the accepted types.
        ValueError: naming the bad item — not an integer, a count below 1, a
            negative device, a bad pair, or forms mixed within one side.
    """
    if isinstance(spec, str):
        text = spec.strip()
        raw: list[Any] = [] if text == "" else text.split(",")
    elif isinstance(spec, (list, tuple)):
        raw = list(spec)
    elif isinstance(spec, int) and not isinstance(spec, bool):
        raw = [spec]  # a YAML value "7" arrives as an int: one stage
    else:
        raise TypeError(
            f"{name} layout must be a string like '7,5' or '0:4,1:3', or a list, "
            f"got {type(spec).__name__}: {spec!r}"
        )
    items: list[str] = []
    forms: list[str] = []
    counts: list[int] = []
    owners: list[int] = []
    ranges: list[range] = []
    for i, item in enumerate(raw):
        label = f"{name} item {i} ({item!r})"
        items.append(item.strip() if isinstance(item, str) else repr(item))
        if isinstance(item, range):
            if item.step != 1 or len(item) == 0:
                raise ValueError(f"{label} must be a non-empty range with step 1")
            forms.append("range")
            ranges.append(item)
            continue
        owner: Any = None
        if isinstance(item, str):
            text = item.strip()
            if text == "":
                raise ValueError(f"{label} is empty; write counts separated by single commas")
            if ":" in text:
                owner, _, count = text.partition(":")
                if ":" in count:
                    raise ValueError(f"{label} has more than one ':'; write device:count")
            else:
                count = text
        elif isinstance(item, (tuple, list)):
            if len(item) != 2:
                raise ValueError(f"{label} must be a (device, count) pair")
            owner, count = item
        else:
            count = item
        c = parse_int(count, f"{label}: the layer count")
        if c < 1:
            raise ValueError(f"{label} has {c} layers; every stage needs at least one layer")
        counts.append(c)
        if owner is None:
            forms.append("count")
        else:
            d = parse_int(owner, f"{label}: the device")
            if d < 0:
                raise ValueError(f"{label} names device {d}; devices are numbered from 0")
            owners.append(d)
            forms.append("device:count")
    kinds = sorted(set(forms))
    if len(kinds) > 1:
        first = {k: forms.index(k) for k in kinds}
        a, b = sorted(kinds, key=first.__getitem__)[:2]
        raise ValueError(
            f"{name} layout mixes forms: item {first[a]} ({items[first[a]]!r}) is a {a} but item "
            f"{first[b]} ({items[first[b]]!r}) is a {b}; use one form for every stage"
        )
    if kinds == ["range"]:
        return ParsedLayout(name, items, None, ranges, None)
    return ParsedLayout(name, items, counts, None, owners if kinds == ["device:count"] else None)


def parse_layout_string(text: str) -> dict[str, str]:
    """Split ``"fwd=7,5 bwd=4,4,4"`` (``;`` also separates) into ``{"fwd": ..., "bwd": ...}``."""
    if not isinstance(text, str):
        raise TypeError(f"layout string must be a str, got {type(text).__name__}")
    parts: dict[str, str] = {}
    for tok in text.replace(";", " ").split():
        key, sep, val = tok.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("fwd", "bwd"):
            raise ValueError(
                f"layout string item {tok!r} is not 'fwd=...' or 'bwd=...'; "
                "write e.g. 'fwd=7,5 bwd=4,4,4'"
            )
        if key in parts:
            raise ValueError(f"layout string gives {key}= twice ({text!r}); give it once")
        parts[key] = val
    return parts


def format_layout(stages: Sequence[range], owners: Sequence[int] | None) -> str:
    """One side as text: ``"7,5"``, or ``"0:4,1:3"`` with owners."""
    if owners is None:
        return ",".join(str(len(r)) for r in stages)
    return ",".join(f"{d}:{len(r)}" for d, r in zip(owners, stages))


def _parse_side(
    layout: LayoutSpec | None, owners: Sequence[int] | None, name: str
) -> ParsedLayout | None:
    """Parse one side with its ``{name}_owners``, if given."""
    if layout is None:
        if owners is not None:
            raise ValueError(f"{name}_owners given without a {name} layout; give {name} too")
        return None
    spec = parse_layout(layout, name)
    if owners is None:
        return spec
    if spec.owners is not None:
        raise ValueError(
            f"owners for {name} are given twice: in the layout ('device:count' items) and as "
            f"{name}_owners={list(owners)!r}; give them one way"
        )
    if isinstance(owners, (str, bytes)) or not isinstance(owners, Sequence):
        raise ValueError(f"{name}_owners must be a list of device indices (ints), got {owners!r}")
    owners = list(owners)
    if len(owners) != len(spec.items):
        raise ValueError(
            f"{name}_owners has {len(owners)} entries but the {name} layout has "
            f"{len(spec.items)} stages; give one owner device per stage"
        )
    spec.owners = [
        check_int(d, f"{name}_owners[{i}]", 0, "a device index") for i, d in enumerate(owners)
    ]
    return spec


def _counts_to_ranges(counts: Sequence[int], end: int, descending: bool) -> list[range]:
    """Forward counts fill layers 0.. upward; backward counts fill ..end downward."""
    bounds = list(accumulate(counts, initial=0))
    if descending:
        return [range(end - b, end - a) for a, b in zip(bounds, bounds[1:])]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_num_devices(num_devices: Any) -> None:
    """``ValueError`` unless ``num_devices`` is ``None`` or an int >= 1."""
    if num_devices is not None:
        check_int(num_devices, "num_devices", why="the pool's size")


def resolve_layout(
    fwd: LayoutSpec | None,
    bwd: LayoutSpec | None,
    num_layers: int | None = None,
    num_devices: int | None = None,
    run_type: RunType | str = RunType.FUSED,
    fwd_owners: Sequence[int] | None = None,
    bwd_owners: Sequence[int] | None = None,
) -> tuple[int, list[range], list[range], list[int] | None, list[int] | None]:
    """``(num_layers, fwd, bwd, fwd_owners, bwd_owners)``: both sides of a layout as stage
    ranges and owners (arguments as in ``ModelExecutePlan.from_layout``), counts checked
    before any range is built."""
    rt = parse_kind(RunType, run_type, "run_type")
    if num_layers is not None:
        check_int(num_layers, "num_layers")
    check_num_devices(num_devices)
    f = _parse_side(fwd, fwd_owners, "fwd")
    b = _parse_side(bwd, bwd_owners, "bwd")
    if f is None and b is None:
        raise ValueError("give at least one of fwd= and bwd= to build a plan from a layout")
    if f is None and rt == RunType.INFER:
        raise ValueError("an 'infer' plan needs fwd=; bwd alone does not define it")
    for spec in (f, b):
        if spec is not None and spec.owners is not None and num_devices is not None:
            for i, d in enumerate(spec.owners):
                if d >= num_devices:
                    raise ValueError(
                        f"{spec.name} item {i} ({spec.items[i]!r}) names device {d}, but the "
                        f"pool has only {num_devices} device(s) (0..{num_devices - 1})"
                    )

    if rt == RunType.FUSED and b is None and num_layers is None:
        raise ValueError(
            "a 'fused' plan from fwd alone needs num_layers (the remaining deepest layers "
            "form the fused stage); give num_layers or bwd"
        )
    if b is not None and not b.items and rt != RunType.INFER:
        raise ValueError(
            f"bwd layout is empty but run_type {rt.value!r} needs backward stages; "
            "give at least one backward stage"
        )
    if b is not None and rt != RunType.INFER:
        total = b.num_layers_covered()
        if num_layers is None:
            num_layers = total
        elif total != num_layers:
            raise ValueError(
                f"bwd stages cover {total} layers ({b.describe()}) but the model has "
                f"{num_layers} layers; the backward stages must cover every layer"
            )
    if f is not None and f.counts is not None:
        total = sum(f.counts)
        if rt == RunType.FUSED:
            assert num_layers is not None  # set above from bwd or required
            if b is not None:
                fused = b.counts[0] if b.counts else len(b.ranges[0]) if b.ranges else 0
                expect = num_layers - fused
                if total != expect:
                    raise ValueError(
                        f"fwd counts add up to {total} ({f.describe()}) but for 'fused' the "
                        f"forward stages cover the layers before the fused stage (bwd item 0, "
                        f"{fused} of {num_layers} layers): {expect} layers"
                    )
            elif total >= num_layers:
                raise ValueError(
                    f"fwd counts add up to {total} ({f.describe()}) but the model has "
                    f"{num_layers} layers; for 'fused' at least the last layer must be left "
                    "for the fused stage"
                )
        elif num_layers is None:
            num_layers = total
        elif total != num_layers:
            raise ValueError(
                f"fwd counts add up to {total} ({f.describe()}) but the model has "
                f"{num_layers} layers; the forward stages must cover every layer"
            )
    if num_layers is None:
        # Only full-range specs were given.
        spec = b if b is not None and rt != RunType.INFER else f
        assert spec is not None
        num_layers = spec.num_layers_covered()
        if num_layers < 1:
            raise ValueError("cannot tell the number of layers from empty layouts; give num_layers")

    fwd_ranges: list[range] | None = None
    bwd_ranges: list[range] | None = None
    if f is not None:
        fwd_ranges = f.ranges if f.counts is None else _counts_to_ranges(f.counts, 0, False)
    if b is not None:
        bwd_ranges = b.ranges if b.counts is None else _counts_to_ranges(b.counts, num_layers, True)
    if fwd_ranges is None:  # mirror the backward stages
        assert bwd_ranges is not None
        mirrored = bwd_ranges[1:] if rt == RunType.FUSED else bwd_ranges
        fwd_ranges = list(reversed(mirrored))
    if bwd_ranges is None:  # mirror the forward stages
        if rt == RunType.INFER:
            bwd_ranges = []
        elif rt == RunType.TRAIN:
            bwd_ranges = list(reversed(fwd_ranges))
        else:
            start = fwd_ranges[-1].stop if fwd_ranges else 0
            bwd_ranges = [range(start, num_layers)] + list(reversed(fwd_ranges))
    fwd_own = f.owners if f is not None else None
    bwd_own = b.owners if b is not None else None
    return num_layers, fwd_ranges, bwd_ranges, fwd_own, bwd_own
