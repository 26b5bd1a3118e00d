"""Execution plans: how the layers of a model are grouped into pipeline stages.

A plan has a forward partition (``fwd_plan``, stages of increasing layer
ranges) and a backward partition (``bwd_plan``, stages of decreasing layer
ranges). They may differ (asymmetric plans). Optionally a stage may be pinned
to a device (``fwd_owners`` / ``bwd_owners``) instead of round-robin dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence

RUN_TYPES = ("infer", "train", "fused")


def _check_run_type(run_type: str) -> None:
    if run_type not in RUN_TYPES:
        raise ValueError(f"run_type must be one of {RUN_TYPES}, got {run_type!r}")


def _check_cover(
    stages: Sequence[range], num_layers: int, name: str, increasing: bool, full: bool = True
) -> None:
    """Validate that ``stages`` covers its layers exactly once in the required order."""
    if not isinstance(stages, (list, tuple)):
        raise TypeError(f"{name} must be a list of range objects, got {type(stages).__name__}")
    seen: dict[int, int] = {}
    prev: range | None = None
    for i, r in enumerate(stages):
        if not isinstance(r, range):
            raise TypeError(f"{name}[{i}] must be a range, got {type(r).__name__}: {r!r}")
        if r.step != 1:
            raise ValueError(f"{name}[{i}] = {r!r} must have step 1")
        if len(r) == 0:
            raise ValueError(f"{name}[{i}] = {r!r} is empty; every stage needs at least one layer")
        if r.start < 0 or r.stop > num_layers:
            raise ValueError(
                f"{name}[{i}] = {r!r} is outside the model's layers 0..{num_layers - 1}"
            )
        for layer in r:
            if layer in seen:
                raise ValueError(
                    f"layer {layer} appears in {name}[{seen[layer]}] and again in {name}[{i}]; "
                    "each layer must appear exactly once"
                )
            seen[layer] = i
        if prev is not None:
            if increasing and r.start < prev.stop:
                raise ValueError(
                    f"{name}[{i}] = {r!r} comes after {name}[{i - 1}] = {prev!r}: forward stages "
                    "must go from shallow to deep layers (increasing order)"
                )
            if not increasing and r.stop > prev.start:
                raise ValueError(
                    f"{name}[{i}] = {r!r} comes after {name}[{i - 1}] = {prev!r}: backward stages "
                    "must go from deep to shallow layers (decreasing order)"
                )
        prev = r
    if full:
        missing = [layer for layer in range(num_layers) if layer not in seen]
        if missing:
            raise ValueError(
                f"{name} does not cover layer {missing[0]}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + f"; the stages must cover all layers 0..{num_layers - 1} exactly once"
            )


class ModelExecutePlan:
    """Stage partition of a model for forward and backward.

    Attributes:
        fwd_plan: forward stages, each a ``range`` of layer indices, shallow to deep.
        bwd_plan: backward stages, deep to shallow.
        fwd_owners: optional device index per forward stage (``None`` = round-robin).
        bwd_owners: optional device index per backward stage (``None`` = round-robin).
    """

    def __init__(
        self,
        fwd_plan: list[range] | None = None,
        bwd_plan: list[range] | None = None,
        fwd_owners: list[int] | None = None,
        bwd_owners: list[int] | None = None,
    ) -> None:
        self.fwd_plan: list[range] = list(fwd_plan) if fwd_plan is not None else []
        self.bwd_plan: list[range] = list(bwd_plan) if bwd_plan is not None else []
        self.fwd_owners = list(fwd_owners) if fwd_owners is not None else None
        self.bwd_owners = list(bwd_owners) if bwd_owners is not None else None

    def __repr__(self) -> str:
        def fmt(stages: list[range]) -> str:
            return "[" + ", ".join(f"{r.start}-{r.stop - 1}" for r in stages) + "]"

        s = f"ModelExecutePlan(fwd={fmt(self.fwd_plan)}, bwd={fmt(self.bwd_plan)}"
        if self.fwd_owners is not None:
            s += f", fwd_owners={self.fwd_owners}"
        if self.bwd_owners is not None:
            s += f", bwd_owners={self.bwd_owners}"
        return s + ")"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelExecutePlan):
            return NotImplemented
        return (
            self.fwd_plan == other.fwd_plan
            and self.bwd_plan == other.bwd_plan
            and self.fwd_owners == other.fwd_owners
            and self.bwd_owners == other.bwd_owners
        )

    def check_valid(self, num_layers: int, run_type: str, num_devices: int | None = None) -> None:
        """Raise ``ValueError`` (naming the offending stage/layer) unless the plan is usable.

        Rules (seed 000): forward stages cover every layer exactly once in increasing
        order ("infer"/"train"); backward stages cover every layer exactly once in
        decreasing order ("train"/"fused"); for "fused" the forward plan covers
        exactly the layers before the first backward stage, which fuses the forward
        of its own layers with the loss and the backward.
        """
        _check_run_type(run_type)
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if run_type in ("infer", "train"):
            if not self.fwd_plan:
                raise ValueError("fwd_plan is empty; give at least one forward stage")
            _check_cover(self.fwd_plan, num_layers, "fwd_plan", increasing=True)
        if run_type in ("train", "fused"):
            if not self.bwd_plan:
                raise ValueError("bwd_plan is empty; give at least one backward stage")
            _check_cover(self.bwd_plan, num_layers, "bwd_plan", increasing=False)
        if run_type == "fused":
            fused_start = self.bwd_plan[0].start
            if fused_start == 0:
                if self.fwd_plan:
                    raise ValueError(
                        "for forward_backward() the first backward stage bwd_plan[0] = "
                        f"{self.bwd_plan[0]!r} already covers layer 0, so fwd_plan must be empty, "
                        f"got {self.fwd_plan!r}"
                    )
            else:
                if not self.fwd_plan:
                    raise ValueError(
                        f"fwd_plan is empty but layers 0..{fused_start - 1} come before the fused "
                        f"stage bwd_plan[0] = {self.bwd_plan[0]!r}; give forward stages for them"
                    )
                _check_cover(self.fwd_plan, fused_start, "fwd_plan", increasing=True)
                if self.fwd_plan[-1].stop != fused_start:
                    raise ValueError(
                        f"for forward_backward() the forward plan must end where the first backward "
                        f"stage starts: fwd_plan[-1] = {self.fwd_plan[-1]!r} ends at layer "
                        f"{self.fwd_plan[-1].stop - 1} but bwd_plan[0] = {self.bwd_plan[0]!r} starts "
                        f"at layer {fused_start}"
                    )
        for name, owners, stages in (
            ("fwd_owners", self.fwd_owners, self.fwd_plan),
            ("bwd_owners", self.bwd_owners, self.bwd_plan),
        ):
            if owners is None:
                continue
            if len(owners) != len(stages):
                raise ValueError(
                    f"{name} has {len(owners)} entries but the plan has {len(stages)} stages; "
                    "give one owner device per stage"
                )
            for i, d in enumerate(owners):
                if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                    raise ValueError(f"{name}[{i}] = {d!r} is not a device index (int >= 0)")
                if num_devices is not None and d >= num_devices:
                    raise ValueError(
                        f"{name}[{i}] = {d} names device {d}, but the pool has only "
                        f"{num_devices} device(s) (0..{num_devices - 1})"
                    )

    @staticmethod
    def uniform(num_layers: int, num_stages: int, run_type: str = "fused") -> ModelExecutePlan:
        """A plain plan: ``num_stages`` forward and backward stages of near-equal layer counts.

        For "fused" the last backward stage (which is launched first) is fused, and
        the forward plan covers the layers before it.
        """
        _check_run_type(run_type)
        num_stages = max(1, min(num_stages, num_layers))
        base, extra = divmod(num_layers, num_stages)
        stages, start = [], 0
        for i in range(num_stages):
            n = base + (1 if i < extra else 0)
            stages.append(range(start, start + n))
            start += n
        bwd = list(reversed(stages))
        fwd = stages if run_type != "fused" else stages[:-1]
        return ModelExecutePlan(fwd, bwd if run_type != "infer" else [])

    # -- layouts: plans from layer counts (and owner devices) per stage ---------
    @staticmethod
    def from_layout(
        fwd: LayoutSpec | None = None,
        bwd: LayoutSpec | None = None,
        num_layers: int | None = None,
        num_devices: int | None = None,
        run_type: str = "fused",
        fwd_owners: Sequence[int] | None = None,
        bwd_owners: Sequence[int] | None = None,
    ) -> ModelExecutePlan:
        """Build a plan from layer counts per stage, optionally with an owner device each.

        A spec is a string fit for YAML or a command line, or a Python list:

        * counts: ``"7,5"`` or ``[7, 5]`` — stage sizes, dispatched round-robin;
        * owners: ``"0:4,0:3,1:3,1:2"`` or ``[(0, 4), (0, 3), (1, 3), (1, 2)]`` —
          ``device:count`` per stage, the stage always runs on that device;
        * full ranges: ``[range(0, 7), range(7, 12)]``;
        * ``""`` or ``[]``: no stages (a "fused" plan whose fused stage holds every layer).

        Forward stages are listed shallow to deep; backward stages deep to shallow
        (launch order), so for "fused" the first backward item is the fused stage.
        A missing side mirrors the other: ``fwd`` defaults to the backward stages
        reversed (without the fused one), ``bwd`` to the forward stages reversed
        (for "fused" with the remaining deepest layers as the fused stage, which
        needs ``num_layers``).

        Args:
            fwd: forward stages.
            bwd: backward stages (deep to shallow).
            num_layers: layers of the model; inferred from the counts when ``None``.
            num_devices: size of the device pool, to check owners; unchecked when ``None``.
            run_type: "infer", "train" or "fused".
            fwd_owners: owner device per forward stage, for count/range specs.
            bwd_owners: owner device per backward stage, for count/range specs.

        Raises:
            ValueError: naming the bad item — not an integer, a zero or negative count,
                counts that do not add up to the layers they cover, an owner outside the
                pool, forms mixed within a spec, owners given twice.
        """
        _check_run_type(run_type)
        if num_layers is not None and (
            not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1
        ):
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        f = _parse_spec(fwd, "fwd") if fwd is not None else None
        b = _parse_spec(bwd, "bwd") if bwd is not None else None
        if f is not None:
            f = _merge_owners(f, fwd_owners, "fwd")
        elif fwd_owners is not None:
            raise ValueError("fwd_owners given without a fwd layout; give fwd too")
        if b is not None:
            b = _merge_owners(b, bwd_owners, "bwd")
        elif bwd_owners is not None:
            raise ValueError("bwd_owners given without a bwd layout; give bwd too")
        if f is None and b is None:
            raise ValueError("give at least one of fwd= and bwd= to build a plan from a layout")
        for spec in (f, b):
            if spec is not None and spec.owners is not None and num_devices is not None:
                for i, d in enumerate(spec.owners):
                    if d >= num_devices:
                        raise ValueError(
                            f"{spec.name} item {i} ({spec.items[i]!r}) names device {d}, but the "
                            f"pool has only {num_devices} device(s) (0..{num_devices - 1})"
                        )

        # Resolve the number of layers and turn counts into ranges.
        if b is not None and b.counts is not None and run_type != "infer":
            total = sum(b.counts)
            if num_layers is None:
                num_layers = total
            elif total != num_layers:
                raise ValueError(
                    f"bwd counts add up to {total} ({b.describe()}) but the model has "
                    f"{num_layers} layers; the backward stages must cover every layer"
                )
        if f is not None and f.counts is not None:
            total = sum(f.counts)
            if run_type == "fused":
                if b is not None and b.counts is not None:
                    expect = num_layers - b.counts[0]
                    if total != expect:
                        raise ValueError(
                            f"fwd counts add up to {total} ({f.describe()}) but for 'fused' the "
                            f"forward stages cover the layers before the fused stage (bwd item 0, "
                            f"{b.counts[0]} layers of {num_layers}): {expect} layers"
                        )
                elif num_layers is None and b is None:
                    raise ValueError(
                        "a 'fused' plan from fwd counts alone needs num_layers (the remaining "
                        "deepest layers form the fused stage); give num_layers or bwd"
                    )
                elif num_layers is not None and total >= num_layers:
                    raise ValueError(
                        f"fwd counts add up to {total} ({f.describe()}) but the model has "
                        f"{num_layers} layers; for 'fused' at least the last layer must be left "
                        "for the fused stage"
                    )
            else:
                if num_layers is None:
                    num_layers = total
                elif total != num_layers:
                    raise ValueError(
                        f"fwd counts add up to {total} ({f.describe()}) but the model has "
                        f"{num_layers} layers; the forward stages must cover every layer"
                    )
        if num_layers is None:
            # Only full-range specs were given.
            spec = b if b is not None and run_type != "infer" else f
            num_layers = max((r.stop for r in spec.ranges), default=0)  # type: ignore[union-attr]
            if num_layers < 1:
                raise ValueError("cannot tell the number of layers from empty layouts; give num_layers")

        fwd_ranges: list[range] | None = None
        bwd_ranges: list[range] | None = None
        if f is not None:
            fwd_ranges = f.ranges if f.counts is None else _counts_to_ranges(f.counts, 0, False)
        if b is not None:
            bwd_ranges = (
                b.ranges if b.counts is None else _counts_to_ranges(b.counts, num_layers, True)
            )
        fo = f.owners if f is not None else None
        bo = b.owners if b is not None else None
        if fwd_ranges is None:  # mirror the backward stages
            if run_type == "infer":
                raise ValueError("an 'infer' plan needs fwd=; bwd alone does not define it")
            assert bwd_ranges is not None
            mirrored = bwd_ranges[1:] if run_type == "fused" else bwd_ranges
            fwd_ranges = list(reversed(mirrored))
        if bwd_ranges is None:  # mirror the forward stages
            if run_type == "infer":
                bwd_ranges = []
            elif run_type == "train":
                bwd_ranges = list(reversed(fwd_ranges))
            else:
                start = fwd_ranges[-1].stop if fwd_ranges else 0
                bwd_ranges = [range(start, num_layers)] + list(reversed(fwd_ranges))
        plan = ModelExecutePlan(fwd_ranges, bwd_ranges, fo, bo)
        plan.check_valid(num_layers, run_type, num_devices)
        return plan

    def to_layout(self) -> dict[str, str]:
        """The plan as layout strings, e.g. ``{"fwd": "7,5", "bwd": "0:4,1:4,0:4"}``.

        ``ModelExecutePlan.from_layout(**plan.to_layout(), run_type=...)`` rebuilds
        a plan whose stages cover layers 0.. contiguously (every valid plan does).
        """
        return {
            "fwd": _format_spec(self.fwd_plan, self.fwd_owners),
            "bwd": _format_spec(self.bwd_plan, self.bwd_owners),
        }

    def to_layout_string(self) -> str:
        """One-line form for logs and configs: ``"fwd=7,5 bwd=4,4,4"``."""
        lay = self.to_layout()
        return f"fwd={lay['fwd']} bwd={lay['bwd']}"

    @staticmethod
    def from_layout_string(
        text: str,
        num_layers: int | None = None,
        num_devices: int | None = None,
        run_type: str = "fused",
    ) -> ModelExecutePlan:
        """Parse :meth:`to_layout_string` output: ``"fwd=7,5 bwd=4,4,4"`` (``;`` also separates)."""
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
        return ModelExecutePlan.from_layout(
            fwd=parts.get("fwd"),
            bwd=parts.get("bwd"),
            num_layers=num_layers,
            num_devices=num_devices,
            run_type=run_type,
        )
