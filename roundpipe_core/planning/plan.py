"""Execution plans, their data and validation: a forward partition (``fwd_plan``,
increasing layer ranges) and a backward one (``bwd_plan``, decreasing), which may differ;
a stage may be pinned to a device (``fwd_owners`` / ``bwd_owners``). The planner sits
above (``ModelExecutePlan.auto`` calls the one installed by :meth:`install_planner`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, overload

from ..kinds import RunType, check_int, parse_kind
from .layout import (
    LayoutSpec,
    check_num_devices,
    format_layout,
    parse_layout_string,
    resolve_layout,
)

__all__ = ["AutoPlanner", "ModelExecutePlan", "default_num_microbatch", "even_ranges"]


def default_num_microbatch(num_devices: int, concurrent: bool = True, replicas: int = 1) -> int:
    """Microbatches per call when none is asked for (the one source of that default):
    devices + 1 where devices compute at the same time (the published default; one more
    fills the fused stage's bubble); else 1 (no bubble to fill, each microbatch more only
    adds work), or ``replicas`` where the one-stage plan runs on every worker at once."""
    return num_devices + 1 if concurrent else max(1, replicas)


def even_ranges(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous ranges, the first ones one longer where
    it does not divide evenly: 3 in 2 -> ``[0, 1], [2]``."""
    base, extra = divmod(n, parts)
    bounds = [k * base + min(k, extra) for k in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


#: What :meth:`ModelExecutePlan.auto` delegates to (``roundpipe_core.planning.planner.auto``).
AutoPlanner = Callable[..., "ModelExecutePlan | list[ModelExecutePlan]"]


def _check_cover(stages: Sequence[range], num_layers: int, name: str, increasing: bool) -> None:
    """Validate that ``stages`` covers its layers exactly once in the required order
    (on the ranges' ends only: a plan claiming millions of layers fails as fast)."""
    if not isinstance(stages, (list, tuple)):
        raise TypeError(f"{name} must be a list of range objects, got {type(stages).__name__}")
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
        if prev is not None:
            # (stages in order are disjoint: only the previous one can overlap this one)
            lo, hi = max(r.start, prev.start), min(r.stop, prev.stop)
            if lo < hi:
                raise ValueError(
                    f"layer {lo} appears in {name}[{i - 1}] and again in {name}[{i}]; "
                    "each layer must appear exactly once"
                )
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
    # (the stages are disjoint by now)
    ordered = sorted(stages, key=lambda r: r.start) + [range(num_layers, num_layers)]
    stops = [0] + [r.stop for r in ordered[:-1]]
    gaps = [range(at, r.start) for at, r in zip(stops, ordered) if r.start > at]
    if gaps:
        missing = sum(len(g) for g in gaps)
        raise ValueError(
            f"{name} does not cover layer {gaps[0].start}"
            + (f" (and {missing - 1} more)" if missing > 1 else "")
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

    #: The automatic planner behind :meth:`auto` (installed on import).
    _planner: ClassVar[AutoPlanner | None] = None

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
        return vars(self) == vars(other)

    def check_valid(
        self, num_layers: int, run_type: RunType | str, num_devices: int | None = None
    ) -> None:
        """Raise ``ValueError`` (naming the offending stage/layer) unless the plan is usable:
        forward stages cover every layer once in increasing order ("infer"/"train");
        backward stages every layer once in decreasing order ("train"/"fused"); for
        "fused" the forward plan covers exactly the layers before the first (fused)
        backward stage. Owners, when given, name one device of the pool per stage.
        """
        rt = parse_kind(RunType, run_type, "run_type")
        check_int(num_layers, "num_layers")
        check_num_devices(num_devices)
        if rt in (RunType.INFER, RunType.TRAIN):
            if not self.fwd_plan:
                raise ValueError("fwd_plan is empty; give at least one forward stage")
            _check_cover(self.fwd_plan, num_layers, "fwd_plan", increasing=True)
        if rt in (RunType.TRAIN, RunType.FUSED):
            if not self.bwd_plan:
                raise ValueError("bwd_plan is empty; give at least one backward stage")
            _check_cover(self.bwd_plan, num_layers, "bwd_plan", increasing=False)
        if rt == RunType.FUSED:
            self._check_fused()
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
                check_int(d, f"{name}[{i}]", 0, "a device index")
                if num_devices is not None and d >= num_devices:
                    raise ValueError(
                        f"{name}[{i}] = {d} names device {d}, but the pool has only "
                        f"{num_devices} device(s) (0..{num_devices - 1})"
                    )

    def _check_fused(self) -> None:
        fused_start = self.bwd_plan[0].start
        if fused_start == 0:
            if self.fwd_plan:
                raise ValueError(
                    "for forward_backward() the first backward stage bwd_plan[0] = "
                    f"{self.bwd_plan[0]!r} already covers layer 0, so fwd_plan must be empty, "
                    f"got {self.fwd_plan!r}"
                )
            return
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

    @staticmethod
    def uniform(
        num_layers: int, num_stages: int, run_type: RunType | str = RunType.FUSED
    ) -> ModelExecutePlan:
        """``num_stages`` stages of near-equal layer counts (for "fused" the deepest fused)."""
        rt = parse_kind(RunType, run_type, "run_type")
        check_int(num_layers, "ModelExecutePlan.uniform: num_layers")
        check_int(num_stages, "ModelExecutePlan.uniform: num_stages")
        stages = even_ranges(num_layers, min(num_stages, num_layers))
        bwd = list(reversed(stages))
        fwd = stages if rt != RunType.FUSED else stages[:-1]
        return ModelExecutePlan(fwd, bwd if rt != RunType.INFER else [])

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-friendly form: ``{"fwd": [[0, 7], [7, 12]], "bwd": [...], ...}``."""
        return {
            "fwd": [[r.start, r.stop] for r in self.fwd_plan],
            "bwd": [[r.start, r.stop] for r in self.bwd_plan],
            "fwd_owners": None if self.fwd_owners is None else list(self.fwd_owners),
            "bwd_owners": None if self.bwd_owners is None else list(self.bwd_owners),
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ModelExecutePlan:
        """Rebuild what :meth:`to_dict` returned (not validated: call :meth:`check_valid`)."""
        if not isinstance(data, dict):
            raise TypeError(f"a plan dict must be a dict, got {type(data).__name__}")
        unknown = set(data) - {"fwd", "bwd", "fwd_owners", "bwd_owners"}
        if unknown:
            raise ValueError(
                f"plan dict has unknown keys {sorted(unknown)}; expected fwd, bwd, "
                "fwd_owners, bwd_owners"
            )

        def stages(key: str) -> list[range]:
            pairs = list(data.get(key) or [])
            for i, pair in enumerate(pairs):
                if (
                    not isinstance(pair, (list, tuple))
                    or len(pair) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
                ):
                    raise ValueError(f"plan dict {key}[{i}] = {pair!r} must be [start, stop]")
            return [range(start, stop) for start, stop in pairs]

        def owners(key: str) -> list[int] | None:
            value = data.get(key)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"plan dict {key} must be a list of device indices or None")
            return None if value is None else list(value)

        return ModelExecutePlan(
            stages("fwd"), stages("bwd"), owners("fwd_owners"), owners("bwd_owners")
        )

    @staticmethod
    def from_layout(
        fwd: LayoutSpec | None = None,
        bwd: LayoutSpec | None = None,
        num_layers: int | None = None,
        num_devices: int | None = None,
        run_type: RunType | str = RunType.FUSED,
        fwd_owners: Sequence[int] | None = None,
        bwd_owners: Sequence[int] | None = None,
    ) -> ModelExecutePlan:
        """Build a plan from layer counts per stage, optionally with an owner device each.

        A spec (:mod:`roundpipe_core.planning.layout`): ``"7,5"`` / ``[7, 5]`` (counts,
        round-robin), ``"0:4,0:3,1:3,1:2"`` / ``[(0, 4), (0, 3), ...]`` (``device:count``),
        ``[range(0, 7), range(7, 12)]``, or ``""`` (no stages).

        Forward stages go shallow to deep, backward stages deep to shallow (for "fused"
        the first is the fused stage). A missing side mirrors the other (for "fused"
        from ``fwd`` alone, the remaining deepest layers are fused: needs ``num_layers``).

        Args:
            fwd: forward stages.
            bwd: backward stages (deep to shallow).
            num_layers: layers of the model; inferred from the counts when ``None``.
            num_devices: size of the device pool, to check owners; unchecked when ``None``.
            run_type: "infer", "train" or "fused".
            fwd_owners: owner device (int) per forward stage, for count/range specs.
            bwd_owners: owner device (int) per backward stage, for count/range specs.

        Raises:
            ValueError: naming the bad item — not an integer, a zero or negative count,
                counts that do not add up to the layers they cover, an owner outside the
                pool, forms mixed within a spec, owners given twice.
        """
        n, fwd_plan, bwd_plan, fwd_own, bwd_own = resolve_layout(
            fwd, bwd, num_layers, num_devices, run_type, fwd_owners, bwd_owners
        )
        plan = ModelExecutePlan(fwd_plan, bwd_plan, fwd_own, bwd_own)
        plan.check_valid(n, run_type, num_devices)
        return plan

    def to_layout(self) -> dict[str, str]:
        """The plan as layout strings, e.g. ``{"fwd": "7,5", "bwd": "0:4,1:4,0:4"}``, which
        ``from_layout(**plan.to_layout(), run_type=...)`` rebuilds."""
        return {
            "fwd": format_layout(self.fwd_plan, self.fwd_owners),
            "bwd": format_layout(self.bwd_plan, self.bwd_owners),
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
        run_type: RunType | str = RunType.FUSED,
    ) -> ModelExecutePlan:
        """Parse :meth:`to_layout_string` output: ``"fwd=7,5 bwd=4,4,4"`` (``;`` also separates)."""
        parts = parse_layout_string(text)
        return ModelExecutePlan.from_layout(
            fwd=parts.get("fwd"),
            bwd=parts.get("bwd"),
            num_layers=num_layers,
            num_devices=num_devices,
            run_type=run_type,
        )

    @overload
    @classmethod
    def auto(cls, run_type: RunType | str, model: Any, /, **options: Any) -> ModelExecutePlan: ...

    @overload
    @classmethod
    def auto(
        cls, run_type: RunType | str, model: Any, other: Any, /, *models: Any, **options: Any
    ) -> list[ModelExecutePlan]: ...

    @classmethod
    def auto(
        cls, run_type: RunType | str, /, *models: Any, **options: Any
    ) -> ModelExecutePlan | list[ModelExecutePlan]:
        """Plan stages from measured layer times: one plan per model (a list for several);
        arguments: :func:`roundpipe_core.planning.planner.auto`."""
        planner = ModelExecutePlan._planner
        if planner is None:
            raise RuntimeError(
                "no automatic planner is installed; import roundpipe_core (which installs "
                "roundpipe_core.planning.planner.auto) or call roundpipe_core.planning.planner.auto directly"
            )
        return planner(run_type, *models, **options)

    @classmethod
    def install_planner(cls, planner: AutoPlanner) -> None:
        """Make ``planner`` the implementation of :meth:`auto` (done once by ``roundpipe_core``)."""
        if not callable(planner):
            raise TypeError(f"planner must be callable, got {type(planner).__name__}")
        ModelExecutePlan._planner = planner
