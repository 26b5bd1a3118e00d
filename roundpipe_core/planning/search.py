"""The stage-partition search behind :func:`roundpipe_core.planning.planner.auto`:
greedy packing per stage-time cap, a search over the caps, then simulation of the
shortlist and a walk to faster neighbouring plans (see :func:`search_plans`).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..kinds import RunType, check_int, parse_kind
from .partition import Partitioner, first_true, with_slack
from .plan import ModelExecutePlan
from .profile import LayerProfile
from .schedule import build_schedule
from .simulate import job_ms, simulated_iteration_ms

__all__ = [
    "OBJECTIVES",
    "PlanSearch",
    "fewest_stage_plans",
    "pipeline_estimate",
    "plan_cost",
    "plan_objective",
    "search_plans",
    "stage_times",
]

_GB = 1024**3


@dataclass
class PlanSearch:
    """One plan per model, the stage time cap (``stage_ms``), the total stage count and
    the objective's ``cost``."""

    plans: list[ModelExecutePlan]
    stage_ms: float
    num_stages: int
    cost: float


class _Problem:
    """One model's partition problem for one run type."""

    def __init__(self, profile: LayerProfile, run_type: RunType, mem_cap: float) -> None:
        self.run_type = run_type
        self.n = profile.num_layers
        self.mem_cap = mem_cap
        fwd, re, bwd = profile.layer_ms()
        fmem, bmem = profile.stage_mem()
        self.fwd = Partitioner(fwd, fmem)
        self.bwd = Partitioner([r + b for r, b in zip(re, bwd)], bmem)
        self.fused = Partitioner([f + b for f, b in zip(fwd, bwd)], bmem)
        self._splits: dict[tuple[int, int, int], list[range] | None] = {}

    def fused_start(self, cap: float) -> int:
        """First layer of the largest fused stage (deepest layers) under ``cap``."""
        return self.fused.cut(self.n, cap, self.mem_cap)

    def stages(self, cap: float) -> float:
        n, m = self.n, self.mem_cap
        if self.run_type == RunType.INFER:
            return self.fwd.count(n, cap, m)
        if self.run_type == RunType.TRAIN:
            return self.fwd.count(n, cap, m) + self.bwd.count(n, cap, m)
        f = self.fused_start(cap)
        if f >= n:
            return math.inf
        return 1 + self.fwd.count(f, cap, m) + self.bwd.count(f, cap, m)

    def work(self, cap: float) -> float:
        """Summed stage time per microbatch under ``cap`` (non-increasing: only "fused"
        depends on it, a larger fused stage saving its recompute)."""
        n = self.n
        total = self.fwd.cost_prefix[n]
        if self.run_type == RunType.TRAIN:
            total += self.bwd.cost_prefix[n]
        elif self.run_type == RunType.FUSED:
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
        if self.run_type == RunType.INFER:
            return self.fwd.segment_sums(n)
        if self.run_type == RunType.TRAIN:
            return self.fwd.segment_sums(n) + self.bwd.segment_sums(n)
        p = self.fused.cost_prefix
        suffix = [p[n] - p[f] for f in range(n)]
        return self.fwd.segment_sums(n - 1) + self.bwd.segment_sums(n - 1) + suffix

    def build(self, cap: float) -> ModelExecutePlan:
        n, m = self.n, self.mem_cap
        fused = self.run_type == RunType.FUSED
        f = self.fused_start(cap) if fused else n  # the layers before the fused stage
        fwd = list(reversed(self.fwd.balanced(f, cap, m)))
        bwd = self.bwd.balanced(f, cap, m) if self.run_type != RunType.INFER else []
        return ModelExecutePlan(fwd, ([range(f, n)] if fused else []) + bwd)

    def _split(self, part: Partitioner, f: int, k: int) -> list[range] | None:
        """Layers 0..f-1 in at most ``k`` even stages (deepest first), or ``None``."""
        key = (id(part), f, k)
        if key not in self._splits:
            self._splits[key] = None
            if f == 0 or k < 1 or k > f:
                self._splits[key] = [] if f == 0 and k == 0 else None
            elif part.count(f, part.cost_prefix[f], self.mem_cap) <= k:
                # Balance to a millionth: the walk ranks plans by simulation anyway.
                cap = part.smallest_cap(f, k, part.cost_prefix[f], self.mem_cap, rel_tol=1e-6)
                self._splits[key] = part.pack(f, cap, self.mem_cap)
        return self._splits[key]

    def neighbours(self, plan: ModelExecutePlan, spread: int) -> Iterator[ModelExecutePlan]:
        """Plans one move from ``plan``: the fused split moved, or the sides given up to
        ``spread`` stages more or fewer; every side balanced."""
        n, rt = self.n, self.run_type
        fused = rt == RunType.FUSED
        f0 = plan.bwd_plan[0].start if fused else n
        kf0 = len(plan.fwd_plan)
        kb0 = len(plan.bwd_plan) - (1 if fused else 0)
        deltas = range(-spread, spread + 1)
        if rt == RunType.INFER:
            moves = [(f0, kf0 + d, kb0) for d in deltas if d]
        else:  # both sides at once too: the best counts often move together
            moves = [(f0, kf0 + a, kb0 + b) for a in deltas for b in deltas if a or b]
        if fused:
            q = self.fused.mem_prefix
            for d in range(-spread, spread + 1):
                f = f0 + d
                if d and 0 <= f < n and q[n] - q[f] <= self.mem_cap * (1 + 1e-12):
                    # Keep each side's stage count, within what the new split allows.
                    moves.append((f, min(max(kf0, 1), f), min(max(kb0, 1), f)))
        for f, kf, kb in moves:
            fw = self._split(self.fwd, f, kf)
            bw = self._split(self.bwd, f, kb) if rt != RunType.INFER else []
            if fw is not None and bw is not None:
                yield ModelExecutePlan(list(reversed(fw)), ([range(f, n)] if fused else []) + bw)


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
    """Estimated iteration time of ``S`` stages of at most ``T`` ms, round-robin on ``N``
    devices with ``M`` microbatches: exactly ``T * max(ceil(S / N) * M + (S - 1) mod N,
    S + M - 1)`` for equal stages, and at least ``M * work_ms / N + (min(N, M) - 1) * T``
    (``work_ms``: summed stage time). Non-decreasing in S, T and the work, which the
    exact search relies on.
    """
    s, n, m = num_stages, num_devices, num_microbatch
    if n == 1 and work_ms > 0:
        return m * work_ms  # one device never waits: the work is the time
    equal = stage_ms * max(-(-s // n) * m + (s - 1) % n, s + m - 1)
    return max(equal, m * work_ms / n + (min(n, m) - 1) * stage_ms)


def plan_cost(
    plan: ModelExecutePlan, profile: LayerProfile, run_type: RunType | str, min_stages: int = 1
) -> tuple[float, int, float]:
    """``(max(num_stages, min_stages) * slowest, num_stages, slowest_stage_ms)``."""
    times = stage_times(plan, profile, run_type)
    slowest = max(times)
    return max(len(times), min_stages) * slowest, len(times), slowest


def stage_times(
    plan: ModelExecutePlan, profile: LayerProfile, run_type: RunType | str
) -> list[float]:
    """Per-microbatch time of every stage the plan runs for ``run_type``, in launch order."""
    fwd, re, bwd = profile.layer_ms()
    return [job_ms(job, fwd, bwd, re) for job in build_schedule(plan, run_type, 1, 1)]


def plan_objective(
    plans: Sequence[ModelExecutePlan],
    profiles: Sequence[LayerProfile],
    run_type: RunType | str,
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
    run_type: RunType | str,
    profiles: Sequence[LayerProfile],
    min_stages: int = 1,
    memory_cap_bytes: float = math.inf,
    method: str = "exact",
    upper_threshold: float = 1.1,
    objective: str = "stages",
    num_devices: int | None = None,
    num_microbatch: int | None = None,
    refine: bool = False,
    walk: bool = True,
    overlap_iterations: bool = False,
) -> PlanSearch:
    """Partition one or more models (jointly: one shared stage time cap T), every stage
    under T and ``memory_cap_bytes``, minimising ``"stages"``, ``max(S, min_stages) * T``,
    or ``"pipeline"``, :func:`pipeline_estimate` (S: the total stage count).

    ``method="exact"`` finds the minimum: the optimal cap is a sum of contiguous layers,
    greedy packing gives the fewest stages for a cap, and both objectives are monotone
    in S and T, so a pruned bisection over the sorted caps suffices. ``method="greedy"``
    tries caps up to ``upper_threshold`` times the slowest layer, as published.

    ``refine=True`` ("pipeline") simulates the optimum's stage count and up to
    :data:`REFINE_SPREAD` more or fewer, plus the greedy pick, and keeps the fastest;
    with ``walk`` each plan then hill-climbs on the simulated time (:func:`_walk`).
    ``overlap_iterations`` times the steady state of overlapped calls.

    Raises:
        ValueError: unknown method / objective / run type, no profiles, or a layer
            that cannot fit ``memory_cap_bytes`` (``auto()`` raises the cap instead,
            with a warning).
    """
    rt = parse_kind(RunType, run_type, "run_type")
    if method not in ("exact", "greedy"):
        raise ValueError(f"method must be 'exact' or 'greedy', got {method!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "pipeline":
        check_int(num_devices, "num_devices", why="objective='pipeline' needs num_devices")
        check_int(num_microbatch, "num_microbatch", why="objective='pipeline' needs num_microbatch")
    elif refine:
        raise ValueError("refine=True needs objective='pipeline'")
    if not profiles:
        raise ValueError("give at least one model to plan")
    check_int(min_stages, "min_stages")
    if upper_threshold < 1.0:
        raise ValueError(f"upper_threshold must be >= 1.0, got {upper_threshold!r}")
    problems = [_Problem(p, rt, memory_cap_bytes) for p in profiles]
    cands = sorted({c for pr in problems for c in pr.candidates()})

    @functools.cache
    def s_at(idx: int) -> float:
        return sum(pr.stages(cands[idx]) for pr in problems)

    @functools.cache
    def w_at(idx: int) -> float:
        return sum(pr.work(cands[idx]) for pr in problems)

    def value(num: float, cap: float, work: float) -> float:
        if objective == "stages":
            return max(num, min_stages) * cap
        return pipeline_estimate(int(num), cap, num_devices, num_microbatch, work)  # type: ignore[arg-type]

    def cost(idx: int) -> float:
        return value(s_at(idx), cands[idx], w_at(idx))

    last_idx = len(cands) - 1
    if s_at(last_idx) == math.inf:  # (feasibility is monotone in the cap)
        raise ValueError(
            f"a layer needs more than the memory cap of {memory_cap_bytes / _GB:.3f} GB per "
            "stage; raise model_memory_limit"
        )

    def fewest(at_most: float) -> int:
        """Smallest cap index whose plans have at most ``at_most`` stages (the stage
        count never grows with the cap)."""
        return first_true(0, last_idx, lambda i: s_at(i) <= at_most)

    first = first_true(0, last_idx, lambda i: s_at(i) < math.inf)  # smallest feasible cap
    best_idx = first

    def consider(idx: int) -> None:
        nonlocal best_idx
        c, b = cost(idx), cost(best_idx)
        if c < b * (1 - 1e-12) or (c <= b * (1 + 1e-12) and cands[idx] < cands[best_idx]):
            best_idx = idx

    greedy_end = bisect.bisect_right(cands, with_slack(cands[first] * upper_threshold))
    if method == "greedy":
        for idx in range(first, greedy_end):
            consider(idx)
    else:
        # Past the first cap with at most min_stages (pipeline: one) stages the
        # objective only grows.
        last = fewest(min_stages if objective == "stages" else 1)
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
    shortlist: list[int] = []  # greedy caps have no shortlist: the walk starts at its pick
    if refine and method == "exact" and num_devices is not None and num_microbatch is not None:
        greedy_pick = min(
            range(first, greedy_end), key=lambda i: (max(s_at(i), min_stages) * cands[i], i)
        )
        shortlist = [best_idx, greedy_pick]
        optimum = int(s_at(best_idx))  # the estimate's best stage count
        for target in range(optimum - REFINE_SPREAD, optimum + REFINE_SPREAD + 1):
            if target >= 1 and s_at(last_idx) <= target:
                shortlist.append(fewest(target))
        shortlist = sorted(set(shortlist), key=lambda i: (cost(i), i))
        # the shortlisted cap whose plans simulate fastest (jointly planned models run one
        # after another), the best estimate on ties
        simulated = {
            i: sum(
                simulated_iteration_ms(
                    pr.build(cands[i]), prof, rt, num_devices, num_microbatch, overlap_iterations
                )
                for prof, pr in zip(profiles, problems)
            )
            for i in shortlist
        }
        chosen = shortlist[0]
        for idx in shortlist:
            if simulated[idx] < simulated[chosen] * (1 - 1e-9):
                chosen = idx
    cap = cands[chosen]
    plans = [pr.build(cap) for pr in problems]
    if refine and walk and num_devices is not None and num_microbatch is not None:
        # Jointly planned models run one after another: each walks on its own, from
        # the chosen plan and from the other shortlisted ones.
        seeds = [cands[i] for i in shortlist if i != chosen][: WALK_SEEDS - 1]
        plans = [
            _walk(
                pr,
                prof,
                [plan] + [pr.build(c) for c in seeds],
                num_devices,
                num_microbatch,
                overlap_iterations,
            )
            for pr, prof, plan in zip(problems, profiles, plans)
        ]
        times = [t for plan, prof in zip(plans, profiles) for t in stage_times(plan, prof, rt)]
        return PlanSearch(plans, max(times), len(times), value(len(times), max(times), sum(times)))
    return PlanSearch(plans, cap, int(s_at(chosen)), cost(chosen))


def fewest_stage_plans(
    run_type: RunType, profiles: Sequence[LayerProfile], memory_cap_bytes: float
) -> list[ModelExecutePlan]:
    """One plan per model with the fewest stages ``memory_cap_bytes`` allows (stage time
    unbounded: capped by the largest a stage can take), each side balanced."""
    problems = [_Problem(p, run_type, memory_cap_bytes) for p in profiles]
    return [pr.build(max(pr.candidates())) for pr in problems]


#: Stages more or fewer per side, or layers the fused split moves, in one walk step.
WALK_SPREAD = 2
#: Walk steps at most from each starting plan (each keeps the fastest neighbour).
WALK_STEPS = 8
#: Starting plans of the walk: the chosen one and the next shortlisted ones.
WALK_SEEDS = 3


def _walk(
    problem: _Problem,
    profile: LayerProfile,
    starts: list[ModelExecutePlan],
    num_devices: int,
    num_microbatch: int,
    overlap: bool = False,
) -> ModelExecutePlan:
    """Hill-climb on the simulated iteration time from each start through its neighbours
    (the cap search's estimate is exact only for equal stages); the fastest plan seen."""
    seen: dict[str, float] = {}

    def simulated(p: ModelExecutePlan) -> float:
        key = p.to_layout_string()
        if key not in seen:
            seen[key] = simulated_iteration_ms(
                p, profile, problem.run_type, num_devices, num_microbatch, overlap
            )
        return seen[key]

    best, best_ms = starts[0], simulated(starts[0])
    for start in starts:
        cur, cur_ms = start, simulated(start)
        for _ in range(WALK_STEPS):
            step, step_ms = cur, cur_ms
            for cand in problem.neighbours(cur, WALK_SPREAD):
                ms = simulated(cand)
                if ms < step_ms * (1 - 1e-9):
                    step, step_ms = cand, ms
            if step is cur:
                break
            cur, cur_ms = step, step_ms
        if cur_ms < best_ms * (1 - 1e-9):
            best, best_ms = cur, cur_ms
    return best
