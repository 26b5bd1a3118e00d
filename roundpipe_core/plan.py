"""Execution plans: how the layers of a model are grouped into pipeline stages.

A plan has a forward partition (``fwd_plan``, stages of increasing layer
ranges) and a backward partition (``bwd_plan``, stages of decreasing layer
ranges). They may differ (asymmetric plans). Optionally a stage may be pinned
to a device (``fwd_owners`` / ``bwd_owners``) instead of round-robin dispatch.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

RUN_TYPES = ("infer", "train", "fused")

#: A layout spec: ``"7,5"``, ``"0:4,0:3"``, ``[7, 5]``, ``[(0, 4), (0, 3)]`` or ``[range(0, 7), ...]``.
LayoutSpec = Union[str, Sequence[Any]]


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
                last = self.fwd_plan[-1]
                if isinstance(last, range) and last.stop != fused_start:
                    raise ValueError(
                        f"for forward_backward() the forward plan must end where the first backward "
                        f"stage starts: fwd_plan[-1] = {last!r} ends at layer "
                        f"{last.stop - 1} but bwd_plan[0] = {self.bwd_plan[0]!r} starts "
                        f"at layer {fused_start}"
                    )
                _check_cover(self.fwd_plan, fused_start, "fwd_plan", increasing=True)
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
        if f is None and run_type == "infer":
            raise ValueError("an 'infer' plan needs fwd=; bwd alone does not define it")
        for spec in (f, b):
            if spec is not None and spec.owners is not None and num_devices is not None:
                for i, d in enumerate(spec.owners):
                    if d >= num_devices:
                        raise ValueError(
                            f"{spec.name} item {i} ({spec.items[i]!r}) names device {d}, but the "
                            f"pool has only {num_devices} device(s) (0..{num_devices - 1})"
                        )

        # Resolve the number of layers and turn counts into ranges.
        if run_type == "fused" and b is None and num_layers is None:
            raise ValueError(
                "a 'fused' plan from fwd alone needs num_layers (the remaining deepest layers "
                "form the fused stage); give num_layers or bwd"
            )
        if b is not None and not b.items and run_type != "infer":
            raise ValueError(
                f"bwd layout is empty but run_type {run_type!r} needs backward stages; "
                "give at least one backward stage"
            )
        if b is not None and run_type != "infer":
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
            if run_type == "fused":
                if b is not None:
                    fused = b.first_size()
                    expect = num_layers - fused  # type: ignore[operator]
                    if total != expect:
                        raise ValueError(
                            f"fwd counts add up to {total} ({f.describe()}) but for 'fused' the "
                            f"forward stages cover the layers before the fused stage (bwd item 0, "
                            f"{fused} of {num_layers} layers): {expect} layers"
                        )
                elif total >= num_layers:  # type: ignore[operator]
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
            assert spec is not None
            num_layers = spec.num_layers_covered()
            if num_layers < 1:
                raise ValueError(
                    "cannot tell the number of layers from empty layouts; give num_layers"
                )

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

    # -- automatic planning -------------------------------------------------------
    @staticmethod
    def auto(
        run_type: str,
        *models: Any,
        min_stages: int | None = None,
        upper_threshold: float = 1.1,
        model_memory_limit: float | None = None,
        method: str = "exact",
        objective: str = "pipeline",
        num_microbatch: int | None = None,
        refine: bool = True,
    ) -> ModelExecutePlan | list[ModelExecutePlan]:
        """Plan stages from measured layer times (seed 000).

        Stages should be even (the slowest sets the pace) and there should be enough
        of them to keep every device busy. Forward stages cost the layers' forward
        time, backward stages recompute + backward, the fused stage of "fused"
        forward + backward. Each stage's memory (parameters, plus gradients for
        backward/fused stages) stays under ``model_memory_limit / 2``: one stage runs
        while the next one's parameters are prefetched.

        The published planner minimises ``max(total stages, min_stages) x slowest
        stage`` (``objective="stages"``) greedily, trying only stage caps between the
        slowest layer and ``upper_threshold`` times that. Here ``method="exact"``
        returns the minimum over all caps (see :func:`search_plans`). Minimised
        exactly, that cost turns out to favour a few huge stages, whose pipeline fill
        and drain it does not charge; so the default ``objective="pipeline"``
        minimises the round-robin iteration time of the stages instead
        (:func:`pipeline_estimate`, exact for equal stages), and ``refine=True``
        simulates the near-optimal candidates and keeps the fastest.
        ``upper_threshold`` only steers ``method="greedy"``, kept as the reference.

        Args:
            run_type: "infer", "train" (``forward()`` then backward through autograd)
                or "fused" (``forward_backward()``).
            *models: RoundPipe models (their ``model_timer`` estimates are used; run a
                few iterations first), or :class:`~roundpipe_core.timer.ModelTimer` /
                :class:`LayerProfile` objects. Several models are planned jointly with
                one shared stage cap (e.g. an encoder and a decoder run one after another).
            min_stages: stages below which the pipeline starves, for ``objective="stages"``;
                default: the number of devices (the largest pool among the models). The
                "pipeline" objective charges starvation itself and uses this only as the
                device count when no model has a pool.
            upper_threshold: search window of ``method="greedy"``.
            model_memory_limit: GB a device may use for the model; default 60% of the
                smallest device's memory (CPU workers report ``ROUNDPIPE_CPU_DEVICE_MEMORY_GB``,
                8 GB unless set). A layer bigger than half of it raises the limit, with a warning.
            method: "exact" (default) or "greedy".
            objective: "pipeline" (default) or "stages" (the published cost).
            num_microbatch: microbatches per iteration, for the "pipeline" objective;
                default number of devices + 1 (RoundPipe's default).
            refine: simulate near-optimal candidates ("pipeline" objective only).

        Returns:
            One plan for one model, a list of plans (in order) for several.
        """
        _check_run_type(run_type)
        if not models:
            raise ValueError("ModelExecutePlan.auto() needs at least one model to plan")
        profiles: list[LayerProfile] = []
        devices: list[int] = []
        capacities: list[int] = []
        for i, m in enumerate(models):
            if isinstance(m, LayerProfile):
                profiles.append(m)
                continue
            timer = getattr(m, "model_timer", m)
            if not hasattr(timer, "fwd_ms") or not hasattr(timer, "layer_param_bytes"):
                raise TypeError(
                    f"model {i} ({type(m).__name__}) is not a RoundPipe model, ModelTimer or "
                    "LayerProfile; pass the RoundPipe objects to plan"
                )
            profiles.append(LayerProfile.from_timer(timer))
            if getattr(m, "num_devices", None) is not None:
                devices.append(int(m.num_devices))
            pool = getattr(m, "pool", None)
            for w in getattr(pool, "workers", ()) or ():
                capacities.append(int(w.memory_capacity()))
        if min_stages is None:
            if not devices:
                raise ValueError(
                    "min_stages is needed when no RoundPipe model is given (it defaults to "
                    "the number of devices)"
                )
            min_stages = max(devices)
        if not isinstance(min_stages, int) or isinstance(min_stages, bool) or min_stages < 1:
            raise ValueError(f"min_stages must be an int >= 1, got {min_stages!r}")
        if model_memory_limit is None:
            limit_bytes = DEFAULT_MEMORY_SHARE * min(capacities) if capacities else math.inf
        else:
            if not isinstance(model_memory_limit, (int, float)) or not model_memory_limit > 0:
                raise ValueError(
                    f"model_memory_limit must be a positive number of GB, got {model_memory_limit!r}"
                )
            limit_bytes = float(model_memory_limit) * _GB
        cap = limit_bytes / 2
        need = 0
        for k, prof in enumerate(profiles):
            fmem, bmem = prof.stage_mem()
            per_layer = fmem if run_type == "infer" else bmem
            big = max(range(len(per_layer)), key=per_layer.__getitem__)
            if per_layer[big] > cap and per_layer[big] > need:
                need = per_layer[big]
                which = (k, big)
        if need > cap:
            warnings.warn(
                f"layer {which[1]} of model {which[0]} needs {need / _GB:.3f} GB in one stage, "
                f"more than model_memory_limit / 2 = {cap / _GB:.3f} GB; planning with a limit "
                f"of {2 * need / _GB:.3f} GB instead (raise model_memory_limit to silence this)",
                RuntimeWarning,
                stacklevel=2,
            )
            cap = float(need)
        num_devices = max(devices) if devices else min_stages
        if num_microbatch is None:
            num_microbatch = num_devices + 1
        result = search_plans(
            run_type,
            profiles,
            min_stages,
            cap,
            method=method,
            upper_threshold=upper_threshold,
            objective=objective,
            num_devices=num_devices,
            num_microbatch=num_microbatch,
            refine=refine and objective == "pipeline" and method == "exact",
        )
        return result.plans[0] if len(models) == 1 else result.plans


# -- layout parsing ---------------------------------------------------------------


@dataclass
class _Spec:
    """A parsed layout spec: exactly one of ``counts`` / ``ranges`` is set."""

    name: str
    items: list[str]
    counts: list[int] | None
    ranges: list[range] | None
    owners: list[int] | None

    def describe(self) -> str:
        if self.counts is not None:
            return "+".join(str(c) for c in self.counts) or "nothing"
        return ", ".join(f"{r.start}-{r.stop - 1}" for r in self.ranges or []) or "nothing"

    def num_layers_covered(self) -> int:
        if self.counts is not None:
            return sum(self.counts)
        return max((r.stop for r in self.ranges or []), default=0)

    def first_size(self) -> int:
        if self.counts is not None:
            return self.counts[0]
        return len(self.ranges[0]) if self.ranges else 0


def _as_int(value: Any, what: str) -> int:
    """An int from an int or a decimal string, else ``ValueError`` naming ``what``."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("+-").isdigit():
            return int(text)
    raise ValueError(f"{what} must be an integer, got {value!r}")


def _parse_spec(spec: LayoutSpec, name: str) -> _Spec:
    """Parse one side's layout (see :meth:`ModelExecutePlan.from_layout`)."""
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
        c = _as_int(count, f"{label}: the layer count")
        if c < 1:
            raise ValueError(f"{label} has {c} layers; every stage needs at least one layer")
        counts.append(c)
        if owner is None:
            forms.append("count")
        else:
            d = _as_int(owner, f"{label}: the device")
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
        return _Spec(name, items, None, ranges, None)
    return _Spec(name, items, counts, None, owners if kinds == ["device:count"] else None)


def _merge_owners(spec: _Spec, owners: Sequence[int] | None, name: str) -> _Spec:
    if owners is None:
        return spec
    if spec.owners is not None:
        raise ValueError(
            f"owners for {name} are given twice: in the layout ('device:count' items) and as "
            f"{name}_owners={list(owners)!r}; give them one way"
        )
    owners = list(owners)
    if len(owners) != len(spec.items):
        raise ValueError(
            f"{name}_owners has {len(owners)} entries but the {name} layout has "
            f"{len(spec.items)} stages; give one owner device per stage"
        )
    checked = []
    for i, d in enumerate(owners):
        d = _as_int(d, f"{name}_owners[{i}]")
        if d < 0:
            raise ValueError(f"{name}_owners[{i}] names device {d}; devices are numbered from 0")
        checked.append(d)
    spec.owners = checked
    return spec


def _counts_to_ranges(counts: Sequence[int], end: int, descending: bool) -> list[range]:
    """Forward counts fill layers 0.. upward; backward counts fill ..end downward."""
    out: list[range] = []
    if descending:
        stop = end
        for c in counts:
            out.append(range(stop - c, stop))
            stop -= c
    else:
        start = 0
        for c in counts:
            out.append(range(start, start + c))
            start += c
    return out


def _format_spec(stages: Sequence[range], owners: Sequence[int] | None) -> str:
    if owners is None:
        return ",".join(str(len(r)) for r in stages)
    return ",".join(f"{d}:{len(r)}" for d, r in zip(owners, stages))


# -- planner ------------------------------------------------------------------------

#: Share of the smallest device's memory that ``auto()`` plans with by default.
DEFAULT_MEMORY_SHARE = 0.6
_GB = 1024**3


@dataclass(frozen=True)
class LayerProfile:
    """What the planner knows about one model: per-layer times (ms) and sizes (bytes).

    Attributes:
        fwd_ms: forward time per layer.
        bwd_ms: backward time per layer (without the recompute).
        re_ms: recompute time per layer; ``None`` = the forward time.
        param_bytes: bytes a stage upload moves per layer; ``None`` = 0 (no memory cap).
        grad_bytes: gradient bytes per layer held by backward stages; ``None`` = ``param_bytes``.
    """

    fwd_ms: Sequence[float]
    bwd_ms: Sequence[float]
    re_ms: Sequence[float] | None = None
    param_bytes: Sequence[int] | None = None
    grad_bytes: Sequence[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.fwd_ms)
        if n < 1:
            raise ValueError("a layer profile needs at least one layer")
        for name in ("bwd_ms", "re_ms", "param_bytes", "grad_bytes"):
            seq = getattr(self, name)
            if seq is not None and len(seq) != n:
                raise ValueError(
                    f"{name} has {len(seq)} entries but fwd_ms has {n}; give one per layer"
                )
        for name in ("fwd_ms", "bwd_ms", "re_ms", "param_bytes", "grad_bytes"):
            seq = getattr(self, name)
            for i, x in enumerate(seq or ()):
                if not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
                    raise ValueError(f"{name}[{i}] = {x!r} must be a finite number >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.fwd_ms)

    @classmethod
    def from_timer(cls, timer: Any) -> LayerProfile:
        """The current estimates of a :class:`~roundpipe_core.timer.ModelTimer`."""
        return cls(
            fwd_ms=timer.fwd_ms,
            bwd_ms=timer.bwd_ms,
            re_ms=timer.re_ms,
            param_bytes=timer.layer_param_bytes,
            grad_bytes=getattr(timer, "layer_grad_bytes", None),
        )

    def stage_mem(self) -> tuple[list[int], list[int]]:
        """Bytes per layer held by a forward stage (params) and a backward/fused stage (+ grads)."""
        params = [int(x) for x in self.param_bytes] if self.param_bytes is not None else None
        if params is None:
            zero = [0] * self.num_layers
            return zero, zero
        grads = [int(x) for x in self.grad_bytes] if self.grad_bytes is not None else params
        return params, [p + g for p, g in zip(params, grads)]


@dataclass
class PlanSearch:
    """Result of a planner search.

    Attributes:
        plans: one plan per model.
        stage_ms: the stage time cap the plans were packed under (their slowest stage
            is at most this).
        num_stages: stages of all models together.
        cost: ``max(num_stages, min_stages) * stage_ms``, the planner's objective.
        memory_cap_bytes: per-stage memory bound used.
        evaluated: stage caps the search evaluated.
    """

    plans: list[ModelExecutePlan]
    stage_ms: float
    num_stages: int
    cost: float
    memory_cap_bytes: float
    evaluated: int


def _prefix(xs: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def _slack(t: float) -> float:
    # Caps are differences of prefix sums; compare with a hair of tolerance so a
    # cap equal to a segment's sum always admits that segment.
    return t + 1e-9 * abs(t) + 1e-12


class _Part:
    """Layers 0..n-1 with a stage cost and a stage memory per layer; packs stages from the end."""

    def __init__(self, cost: Sequence[float], mem: Sequence[int]) -> None:
        self.cost_prefix = _prefix(cost)
        self.mem_prefix = _prefix([float(m) for m in mem])
        self._sums: dict[int, list[float]] = {}

    def cut(self, j: int, cap: float, mem_cap: float) -> int:
        """Smallest i such that layers i..j-1 fit one stage (== j when not even one fits)."""
        p, q = self.cost_prefix, self.mem_prefix
        i = bisect.bisect_left(p, p[j] - _slack(cap), 0, j)
        k = bisect.bisect_left(q, q[j] - mem_cap * (1 + 1e-12), 0, j)
        return max(i, k)

    def count(self, n: int, cap: float, mem_cap: float) -> float:
        """Fewest stages covering layers 0..n-1 (greedy from the end is optimal here)."""
        p, q = self.cost_prefix, self.mem_prefix
        slack, mslack = _slack(cap), mem_cap * (1 + 1e-12)
        left = bisect.bisect_left
        stages, j = 0, n
        while j > 0:
            i = left(p, p[j] - slack, 0, j)
            if mslack != math.inf:
                k = left(q, q[j] - mslack, 0, j)
                i = i if i > k else k
            if i >= j:
                return math.inf
            stages += 1
            j = i
        return stages

    def pack(self, n: int, cap: float, mem_cap: float) -> list[range]:
        """The stages of :meth:`count`, deepest first."""
        out, j = [], n
        while j > 0:
            i = self.cut(j, cap, mem_cap)
            if i >= j:
                raise AssertionError("pack() called with an infeasible cap")
            out.append(range(i, j))
            j = i
        return out

    def segment_sums(self, n: int) -> list[float]:
        """Sorted costs of every contiguous run of layers inside 0..n-1."""
        if n not in self._sums:
            p = self.cost_prefix
            self._sums[n] = sorted({p[j] - p[i] for i in range(n) for j in range(i + 1, n + 1)})
        return self._sums[n]

    def balanced(self, n: int, cap: float, mem_cap: float) -> list[range]:
        """Stages as few as under ``cap`` but packed under the smallest cap that keeps them few."""
        if n == 0:
            return []
        k = self.count(n, cap, mem_cap)
        sums = self.segment_sums(n)
        lo, hi = 0, bisect.bisect_right(sums, _slack(cap))
        hi = min(hi, len(sums) - 1)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.count(n, sums[mid], mem_cap) <= k:
                hi = mid
            else:
                lo = mid + 1
        best = sums[lo] if self.count(n, sums[lo], mem_cap) <= k else cap
        return self.pack(n, min(best, cap), mem_cap)


class _Problem:
    """One model's partition problem for one run type."""

    def __init__(self, profile: LayerProfile, run_type: str, mem_cap: float) -> None:
        self.run_type = run_type
        self.n = profile.num_layers
        self.mem_cap = mem_cap
        fwd = list(profile.fwd_ms)
        bwd = list(profile.bwd_ms)
        re = list(profile.re_ms) if profile.re_ms is not None else fwd
        fmem, bmem = profile.stage_mem()
        self.fwd = _Part(fwd, fmem)
        self.bwd = _Part([r + b for r, b in zip(re, bwd)], bmem)
        self.fused = _Part([f + b for f, b in zip(fwd, bwd)], bmem)

    def fused_start(self, cap: float) -> int:
        """First layer of the largest fused stage (deepest layers) under ``cap``."""
        return self.fused.cut(self.n, cap, self.mem_cap)

    def stages(self, cap: float) -> float:
        n, m = self.n, self.mem_cap
        if self.run_type == "infer":
            return self.fwd.count(n, cap, m)
        if self.run_type == "train":
            return self.fwd.count(n, cap, m) + self.bwd.count(n, cap, m)
        f = self.fused_start(cap)
        if f >= n:
            return math.inf
        return 1 + self.fwd.count(f, cap, m) + self.bwd.count(f, cap, m)

    def work(self, cap: float) -> float:
        """Summed stage time (per microbatch) of the plan packed under ``cap``.

        Only "fused" depends on the cap: a larger fused stage saves its recompute.
        Non-increasing in the cap.
        """
        n = self.n
        total = self.fwd.cost_prefix[n]
        if self.run_type == "train":
            total += self.bwd.cost_prefix[n]
        elif self.run_type == "fused":
            f = min(self.fused_start(cap), n)
            total = (
                self.fwd.cost_prefix[f]
                + self.bwd.cost_prefix[f]
                + self.fused.cost_prefix[n]
                - self.fused.cost_prefix[f]
            )
        return total

    def candidates(self) -> list[float]:
        """Every stage time a plan of this model can have."""
        n = self.n
        if self.run_type == "infer":
            return self.fwd.segment_sums(n)
        if self.run_type == "train":
            return self.fwd.segment_sums(n) + self.bwd.segment_sums(n)
        p = self.fused.cost_prefix
        suffix = [p[n] - p[f] for f in range(n)]
        return self.fwd.segment_sums(n - 1) + self.bwd.segment_sums(n - 1) + suffix

    def build(self, cap: float) -> ModelExecutePlan:
        n, m = self.n, self.mem_cap
        if self.run_type == "fused":
            f = self.fused_start(cap)
            fwd = list(reversed(self.fwd.balanced(f, cap, m)))
            bwd = [range(f, n)] + self.bwd.balanced(f, cap, m)
            return ModelExecutePlan(fwd, bwd)
        fwd = list(reversed(self.fwd.balanced(n, cap, m)))
        bwd = self.bwd.balanced(n, cap, m) if self.run_type == "train" else []
        return ModelExecutePlan(fwd, bwd)


OBJECTIVES = ("stages", "pipeline")
#: The refinement step also simulates stage counts this far from the estimate's optimum.
REFINE_SPREAD = 2


def pipeline_estimate(
    num_stages: int,
    stage_ms: float,
    num_devices: int,
    num_microbatch: int,
    work_ms: float = 0.0,
) -> float:
    """Estimated iteration time of a plan under round-robin dispatch.

    Device ``d`` runs stages ``d, d + N, ...``, each for all ``M`` microbatches; a
    stage starts once its device is free and the previous stage finished its first
    microbatch. With ``S`` equal stages of ``T`` this gives exactly
    ``T * max(ceil(S / N) * M + (S - 1) mod N, S + M - 1)`` (the simulator agrees).
    Stages are rarely equal, so the estimate is at least the work spread over the
    devices plus the fill/drain ramp, ``M * work_ms / N + (min(N, M) - 1) * T``,
    where ``work_ms`` is the summed stage time per microbatch (on one device this
    is the exact answer; a larger fused stage saves recompute work). For equal
    stages this never exceeds the exact formula, so that case stays exact. The
    equal-stage term is pessimistic for uneven stages; ``refine`` corrects that.

    It is non-decreasing in the stage count, the stage time and the work, which
    the exact search relies on.
    """
    s, n, m = num_stages, num_devices, num_microbatch
    if n == 1 and work_ms > 0:
        return m * work_ms  # one device never waits: the work is the time
    equal = stage_ms * max(-(-s // n) * m + (s - 1) % n, s + m - 1)
    return max(equal, m * work_ms / n + (min(n, m) - 1) * stage_ms)


def plan_cost(
    plan: ModelExecutePlan, profile: LayerProfile, run_type: str, min_stages: int = 1
) -> tuple[float, int, float]:
    """The published cost of one plan: ``(cost, num_stages, slowest_stage_ms)``.

    Forward stages cost their forward time, backward stages recompute + backward,
    the fused stage forward + backward; ``cost = max(num_stages, min_stages) * slowest``.
    """
    times = stage_times(plan, profile, run_type)
    slowest = max(times)
    return max(len(times), min_stages) * slowest, len(times), slowest


def stage_times(plan: ModelExecutePlan, profile: LayerProfile, run_type: str) -> list[float]:
    """Per-microbatch time of every stage the plan runs for ``run_type``, in launch order."""
    fwd = list(profile.fwd_ms)
    re = list(profile.re_ms) if profile.re_ms is not None else fwd
    bwd = list(profile.bwd_ms)
    times = []
    if run_type in ("infer", "train", "fused"):
        times += [sum(fwd[i] for i in r) for r in plan.fwd_plan]
    if run_type in ("train", "fused"):
        for k, r in enumerate(plan.bwd_plan):
            first = fwd if (run_type == "fused" and k == 0) else re
            times.append(sum(first[i] + bwd[i] for i in r))
    return times


def plan_objective(
    plans: Sequence[ModelExecutePlan],
    profiles: Sequence[LayerProfile],
    run_type: str,
    objective: str = "stages",
    min_stages: int = 1,
    num_devices: int | None = None,
    num_microbatch: int | None = None,
) -> float:
    """The value :func:`search_plans` minimises, for given plans (one per model)."""
    times = [t for plan, prof in zip(plans, profiles) for t in stage_times(plan, prof, run_type)]
    if objective == "stages":
        return max(len(times), min_stages) * max(times)
    return pipeline_estimate(len(times), max(times), num_devices, num_microbatch, sum(times))  # type: ignore[arg-type]


def search_plans(
    run_type: str,
    profiles: Sequence[LayerProfile],
    min_stages: int = 1,
    memory_cap_bytes: float = math.inf,
    method: str = "exact",
    upper_threshold: float = 1.1,
    objective: str = "stages",
    num_devices: int | None = None,
    num_microbatch: int | None = None,
    refine: bool = False,
) -> PlanSearch:
    """Partition one or more models (planned jointly: one shared stage time cap).

    Every stage's time stays under the cap and its memory under ``memory_cap_bytes``.
    Objectives (functions of the total stage count S and the cap T):

    * ``"stages"`` — the published planner's ``max(S, min_stages) * T``;
    * ``"pipeline"`` — :func:`pipeline_estimate`, the round-robin iteration time of
      S stages of time T on ``num_devices`` devices with ``num_microbatch``
      microbatches. It also charges the pipeline's fill and drain, which the
      published cost ignores (minimised exactly, that cost prefers a few huge
      stages: fewer stages, less slack, but a longer ramp).

    ``method="exact"`` finds the minimum: the optimal cap is the time of some stage,
    so it is one of the sums of contiguous layers; the stage count is a
    non-increasing step function of the cap, computed by greedy packing (optimal
    for a fixed cap), and both objectives are non-decreasing in S and T, so a
    pruned bisection over the sorted candidate caps visits only caps where the
    count drops and the objective can still improve.
    ``method="greedy"`` is the published search, kept as a reference: only caps
    between the slowest layer and ``upper_threshold`` times that are tried.

    ``refine=True`` (with the "pipeline" objective) then runs the event simulator
    on the plans with the optimum's stage count and up to two stages fewer or more
    (each at its smallest cap), plus the greedy search's pick, and keeps the
    fastest: with uneven stages the estimate, exact for equal stages, can misrank
    close candidates.

    Raises:
        ValueError: unknown method / objective / run type, no profiles, or a layer
            that cannot fit ``memory_cap_bytes`` (``auto()`` raises the cap instead,
            with a warning).
    """
    _check_run_type(run_type)
    if method not in ("exact", "greedy"):
        raise ValueError(f"method must be 'exact' or 'greedy', got {method!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "pipeline":
        for name, v in (("num_devices", num_devices), ("num_microbatch", num_microbatch)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"objective='pipeline' needs {name} (an int >= 1), got {v!r}")
    elif refine:
        raise ValueError("refine=True needs objective='pipeline'")
    if not profiles:
        raise ValueError("give at least one model to plan")
    if not isinstance(min_stages, int) or min_stages < 1:
        raise ValueError(f"min_stages must be an int >= 1, got {min_stages!r}")
    if upper_threshold < 1.0:
        raise ValueError(f"upper_threshold must be >= 1.0, got {upper_threshold!r}")
    problems = [_Problem(p, run_type, memory_cap_bytes) for p in profiles]
    cands = sorted({c for pr in problems for c in pr.candidates()})
    counts: dict[int, float] = {}
    works: dict[int, float] = {}

    def s_at(idx: int) -> float:
        if idx not in counts:
            counts[idx] = sum(pr.stages(cands[idx]) for pr in problems)
        return counts[idx]

    def w_at(idx: int) -> float:
        if idx not in works:
            works[idx] = sum(pr.work(cands[idx]) for pr in problems)
        return works[idx]

    def value(num: float, cap: float, work: float) -> float:
        if objective == "stages":
            return max(num, min_stages) * cap
        return pipeline_estimate(int(num), cap, num_devices, num_microbatch, work)  # type: ignore[arg-type]

    def cost(idx: int) -> float:
        return value(s_at(idx), cands[idx], w_at(idx))

    # Smallest feasible cap (feasibility is monotone in the cap).
    if s_at(len(cands) - 1) == math.inf:
        raise ValueError(
            f"a layer needs more than the memory cap of {memory_cap_bytes / _GB:.3f} GB per "
            "stage; raise model_memory_limit"
        )
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if s_at(mid) < math.inf:
            hi = mid
        else:
            lo = mid + 1
    first = lo
    best_idx = first

    def consider(idx: int) -> None:
        nonlocal best_idx
        c, b = cost(idx), cost(best_idx)
        if c < b * (1 - 1e-12) or (c <= b * (1 + 1e-12) and cands[idx] < cands[best_idx]):
            best_idx = idx

    greedy_end = bisect.bisect_right(cands, _slack(cands[first] * upper_threshold))
    if method == "greedy":
        for idx in range(first, greedy_end):
            consider(idx)
    else:
        # Past the first cap with at most min_stages (pipeline: one) stages the
        # objective only grows.
        floor = min_stages if objective == "stages" else 1
        lo, hi = first, len(cands) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if s_at(mid) <= floor:
                hi = mid
            else:
                lo = mid + 1
        last = lo
        consider(first)
        consider(last)
        stack = [(first, last)]
        while stack:
            a, b = stack.pop()
            if b - a < 2 or (s_at(a) == s_at(b) and (objective == "stages" or w_at(a) == w_at(b))):
                continue  # same count (and work) throughout: the left end is the cheapest
            # Between a and b: at least b's stages and work (both non-increasing in
            # the cap) and at least a's next cap.
            if value(s_at(b), cands[a + 1], w_at(b)) >= cost(best_idx) * (1 + 1e-12):
                continue  # nothing in between can beat the best so far
            mid = (a + b) // 2
            consider(mid)
            stack.append((mid, b))
            stack.append((a, mid))
    chosen = best_idx
    if refine and method == "exact":
        greedy_pick = min(
            range(first, greedy_end), key=lambda i: (max(s_at(i), min_stages) * cands[i], i)
        )
        shortlist = [best_idx, greedy_pick]
        for target in range(
            int(s_at(best_idx)) - REFINE_SPREAD, int(s_at(best_idx)) + REFINE_SPREAD + 1
        ):
            if target < 1:
                continue
            lo, hi = first, len(cands) - 1  # smallest cap with at most `target` stages
            if s_at(hi) > target:
                continue
            while lo < hi:
                mid = (lo + hi) // 2
                if s_at(mid) <= target:
                    hi = mid
                else:
                    lo = mid + 1
            shortlist.append(lo)
        chosen = _refine(
            run_type,
            profiles,
            problems,
            cands,
            sorted(set(shortlist), key=lambda i: (cost(i), i)),
            num_devices,
            num_microbatch,  # type: ignore[arg-type]
        )
    cap = cands[chosen]
    total = int(s_at(chosen))
    return PlanSearch(
        plans=[pr.build(cap) for pr in problems],
        stage_ms=cap,
        num_stages=total,
        cost=cost(chosen),
        memory_cap_bytes=memory_cap_bytes,
        evaluated=len(counts),
    )


def _refine(
    run_type: str,
    profiles: Sequence[LayerProfile],
    problems: Sequence[_Problem],
    cands: list[float],
    shortlist: list[int],
    num_devices: int,
    num_microbatch: int,
) -> int:
    """Of the shortlisted caps (best estimate first), the one whose plans simulate fastest."""
    from .simulate import makespan_ms  # simulate imports this module

    best, best_time = shortlist[0], math.inf
    for idx in shortlist:
        total = 0.0
        for prof, pr in zip(profiles, problems):
            plan = pr.build(cands[idx])
            # Jointly planned models run one after another.
            total += makespan_ms(
                plan,
                prof.fwd_ms,
                prof.bwd_ms,
                num_devices,
                num_microbatch,
                run_type=run_type,
                re_ms=prof.re_ms,
            )
        if total < best_time * (1 - 1e-9):
            best, best_time = idx, total
    return best
