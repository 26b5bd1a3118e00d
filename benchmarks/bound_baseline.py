"""The weight-binding baseline that ``benchmarks/planner.py`` measures RoundPipe against.

The same layers cut into stages (shallow to deep), stage i fixed on device
i mod N with its weights resident (no uploads), scheduled GPipe-style or 1F1B.
Its events and summary are the engine simulator's
(:mod:`roundpipe_core.planning.simulate`), so the two compare directly. The engine never
runs this schedule, so it lives beside the benchmark, not in the planning wing.
"""

from __future__ import annotations

from collections.abc import Sequence

from roundpipe_core.kinds import JobKind, RunType, parse_kind
from roundpipe_core.planning.partition import Partitioner
from roundpipe_core.planning.plan import ModelExecutePlan
from roundpipe_core.planning.simulate import SimEvent, SimResult, per_layer, summarize

__all__ = ["BOUND_SCHEDULES", "balanced_stages", "simulate_bound", "simulate_bound_stages"]

BOUND_SCHEDULES = ("1f1b", "gpipe")


def simulate_bound(
    plan: ModelExecutePlan,
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    num_devices: int,
    num_microbatch: int,
    run_type: RunType | str = RunType.FUSED,
    re_ms: Sequence[float] | None = None,
    activation_ms: float = 0.0,
    schedule: str = "1f1b",
    iterations: int = 1,
) -> SimResult:
    """``plan``'s backward stages (its forward stages for "infer"), shallow to deep,
    bound to devices: :func:`simulate_bound_stages` (the last stage fused for "fused")."""
    rt = parse_kind(RunType, run_type, "run_type")
    plan.check_valid(len(fwd_ms), rt, num_devices)
    stages = list(reversed(plan.bwd_plan)) if rt != RunType.INFER else list(plan.fwd_plan)
    return simulate_bound_stages(
        stages,
        fwd_ms,
        bwd_ms,
        num_devices,
        num_microbatch,
        re_ms=re_ms,
        backward=rt != RunType.INFER,
        fused_last=rt == RunType.FUSED,
        activation_ms=activation_ms,
        schedule=schedule,
        iterations=iterations,
    )


def simulate_bound_stages(
    stages: Sequence[range],
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    num_devices: int,
    num_microbatch: int,
    re_ms: Sequence[float] | None = None,
    backward: bool = True,
    fused_last: bool = True,
    activation_ms: float = 0.0,
    schedule: str = "1f1b",
    iterations: int = 1,
) -> SimResult:
    """Weight-binding pipeline: ``stages`` (shallow to deep), stage i on device i mod N.

    Weights stay on their device (no uploads). A stage's backward recomputes its
    forward (activation checkpointing, as RoundPipe does) except the last stage's
    when ``fused_last`` (its forward and backward run back to back, as in 1F1B).

    Args:
        stages: contiguous layer ranges covering the model, shallow to deep.
        schedule: "1f1b" (at most one stage per device) or "gpipe" (all forwards, then
            all backwards; several stages per device run breadth-first).
        iterations: iterations back to back, each after the previous one (bound
            pipelines flush at every optimizer step).
    """
    if schedule not in BOUND_SCHEDULES:
        raise ValueError(f"schedule must be one of {BOUND_SCHEDULES}, got {schedule!r}")
    n = len(fwd_ms)
    fwd = per_layer(fwd_ms, n, "fwd_ms")
    bwd = per_layer(bwd_ms, n, "bwd_ms")
    re = per_layer(re_ms, n, "re_ms") if re_ms is not None else list(fwd)
    num_stages = len(stages)
    if schedule == "1f1b" and num_stages > num_devices:
        raise ValueError(
            f"1F1B binds one stage per device but there are {num_stages} stages on "
            f"{num_devices} devices; use schedule='gpipe' or fewer stages"
        )
    ftime = [sum(fwd[i] for i in r) for r in stages]
    btime = [
        sum((0.0 if (fused_last and s == num_stages - 1) else re[i]) + bwd[i] for i in r)
        for s, r in enumerate(stages)
    ]
    M = num_microbatch
    dev_of = [s % num_devices for s in range(num_stages)]
    # Per-device unit order: ("F"|"B", stage, microbatch).
    order: list[list[tuple[str, int, int]]] = [[] for _ in range(num_devices)]
    if schedule == "gpipe" or not backward:
        for d in range(num_devices):
            mine = [s for s in range(num_stages) if dev_of[s] == d]
            order[d] += [("F", s, m) for s in mine for m in range(M)]
            if backward:
                order[d] += [("B", s, m) for s in reversed(mine) for m in range(M)]
    else:
        for s in range(num_stages):
            warm = min(num_stages - s - 1, M)
            ops = [("F", s, m) for m in range(warm)]
            for k in range(M - warm):
                ops += [("F", s, warm + k), ("B", s, k)]
            ops += [("B", s, m) for m in range(M - warm, M)]
            order[dev_of[s]] += ops
    events: list[SimEvent] = []
    offset = 0.0
    for it in range(iterations):
        offset = _run_bound(order, dev_of, ftime, btime, M, activation_ms, offset, it, events)
    return summarize(events, num_devices, [], iterations)


def _run_bound(
    order: list[list[tuple[str, int, int]]],
    dev_of: list[int],
    ftime: list[float],
    btime: list[float],
    M: int,
    act: float,
    offset: float,
    it: int,
    events: list[SimEvent],
) -> float:
    num_stages = len(ftime)
    end: dict[tuple[str, int, int], float] = {}
    free = [offset] * len(order)
    pos = [0] * len(order)
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for d, ops in enumerate(order):
            while pos[d] < len(ops):
                kind, s, m = ops[pos[d]]
                if kind == "F":
                    dep = ("F", s - 1, m) if s > 0 else None
                else:
                    dep = ("B", s + 1, m) if s < num_stages - 1 else ("F", s, m)
                if dep is not None and dep not in end:
                    break
                ready = free[d]
                if dep is not None:
                    src = dev_of[dep[1]]
                    ready = max(ready, end[dep] + (act if src != d else 0.0))
                dur = ftime[s] if kind == "F" else btime[s]
                end[kind, s, m] = ready + dur
                free[d] = ready + dur
                events.append(
                    SimEvent(d, JobKind.from_code(kind).value, s, m, ready, ready + dur, -1, it)
                )
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError("bound schedule deadlocked")
    return max(free)


def balanced_stages(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous partition of layers into at most ``num_stages`` stages minimising the
    largest stage cost (shallow to deep) — the best a weight-bound pipeline can do."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    n = len(costs)
    if n == 0:
        return []
    part = Partitioner(costs)
    everything = part.cost_prefix[n]  # one stage of every layer always fits
    return list(reversed(part.pack(n, part.smallest_cap(n, num_stages, everything))))
