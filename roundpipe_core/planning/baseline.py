"""The weight-binding baseline that RoundPipe is measured against.

The same layers cut into stages (shallow to deep), stage i fixed on device
i mod N with its weights resident (no uploads), scheduled GPipe-style or 1F1B.
Its events and summary are the simulator's, so the two compare directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..kinds import JobKind
from .partition import min_max_partition
from .simresult import SimEvent, SimResult, per_layer, summarize

__all__ = ["BOUND_SCHEDULES", "balanced_stages", "simulate_bound_stages"]

BOUND_SCHEDULES = ("1f1b", "gpipe")


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
                    SimEvent(
                        d,
                        JobKind.from_code(kind).value,
                        s,
                        m,
                        ready,
                        ready + dur,
                        -1,
                        it,
                    )
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
    return min_max_partition(costs, num_stages)
