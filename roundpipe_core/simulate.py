"""Event simulator of one iteration of a plan on N devices.

It times the job list that :func:`roundpipe_core.schedule.build_schedule` returns
— the same list the runtime executes — with the engine's rules:

* each device runs its jobs in launch order, one at a time, and a job runs its
  microbatches in order;
* stage k of microbatch m waits for stage k-1 of microbatch m: the forward
  stages form a chain, then the fused stage, then the backward stages (deep to
  shallow); a backward stage also needs the saved input of its first layer,
  produced by the forward stage that ran the layer before it;
* with ``run_type="train"`` the backward phase starts once the whole forward
  phase (and the loss outside the pipeline) is done;
* optionally, a stage's parameter upload (``upload_ms``) runs on a separate
  channel of its device and may be prefetched while the previous job on that
  device runs (a device holds at most the running and the prefetched stage),
  and handing activations to another device costs ``activation_ms``.

``policy="bound"`` simulates the weight-binding baseline the paper compares
against: the same layers cut into the backward plan's stages (shallow to deep),
stage i fixed on device i mod N with its weights resident (no uploads),
scheduled GPipe-style or 1F1B.

Bubble ratio = share of device time without model computation over
``makespan x devices``; efficiency = 1 - bubble ratio.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from .plan import ModelExecutePlan
from .schedule import BACKWARD, FORWARD, FUSED, Job, build_schedule

POLICIES = ("roundrobin", "bound")
BOUND_SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class SimEvent:
    """One interval on a device's timeline.

    Attributes:
        device: device index.
        kind: "forward", "fused", "backward" (compute) or "upload" (parameter copy).
        stage: stage index in its plan (bound policy: the bound stage).
        microbatch: microbatch index (-1 for uploads).
        start: start time (ms).
        end: end time (ms).
        job: index of the job in the schedule (-1 for the bound policy).
        iteration: iteration index (0 unless several are simulated).
    """

    device: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    job: int = -1
    iteration: int = 0


@dataclass
class SimResult:
    """What :func:`simulate` measured.

    Attributes:
        makespan_ms: time from the first job's start to the last computation's end.
        busy_ms: model-computation time per device.
        bubble_ratio: ``1 - sum(busy_ms) / (makespan_ms * num_devices)``.
        efficiency: ``sum(busy_ms) / (makespan_ms * num_devices)``.
        events: the timeline, compute and upload intervals.
        jobs: the schedule that was timed (round-robin policy).
        iteration_ms: makespan divided by the number of iterations simulated.
    """

    makespan_ms: float
    busy_ms: list[float]
    bubble_ratio: float
    efficiency: float
    events: list[SimEvent] = field(repr=False)
    jobs: list[Job] = field(default_factory=list, repr=False)
    iteration_ms: float = 0.0

    def chrome_trace(self) -> dict:
        """The timeline in Chrome's trace-event format (open in ``chrome://tracing``
        or Perfetto): one row per device, uploads on a row of their own."""
        events = []
        for e in self.events:
            events.append(
                {
                    "name": f"{e.kind} s{e.stage}"
                    + (f" mb{e.microbatch}" if e.microbatch >= 0 else ""),
                    "cat": e.kind,
                    "ph": "X",
                    "ts": e.start * 1000.0,  # microseconds
                    "dur": (e.end - e.start) * 1000.0,
                    "pid": 0,
                    "tid": f"device {e.device}" + (" upload" if e.kind == "upload" else ""),
                    "args": {"job": e.job, "iteration": e.iteration},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def timeline(self, width: int = 80) -> str:
        """ASCII rendering of the compute intervals, one row per device."""
        if self.makespan_ms <= 0:
            return ""
        rows = []
        scale = width / self.makespan_ms
        ndev = len(self.busy_ms)
        for d in range(ndev):
            row = [" "] * width
            for e in self.events:
                if e.device != d or e.kind == "upload":
                    continue
                ch = {"forward": "F", "fused": "X", "backward": "B"}[e.kind]
                a = min(width - 1, int(e.start * scale))
                b = max(a + 1, min(width, int(round(e.end * scale))))
                for x in range(a, b):
                    row[x] = ch
            rows.append(f"dev{d} |" + "".join(row) + "|")
        return "\n".join(rows)


def _per_layer(values: Sequence[float] | float | None, n: int, name: str) -> list[float]:
    if values is None:
        return [0.0] * n
    if isinstance(values, (int, float)):
        return [float(values)] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries but the model has {n} layers")
    for i, v in enumerate(values):
        if not v >= 0:
            raise ValueError(f"{name}[{i}] = {v!r} must be >= 0")
    return [float(v) for v in values]


def _finish(
    events: list[SimEvent], num_devices: int, jobs: list[Job], iterations: int
) -> SimResult:
    compute = [e for e in events if e.kind != "upload"]
    t0 = min(e.start for e in events) if events else 0.0
    makespan = max(e.end for e in compute) - t0 if compute else 0.0
    busy = [0.0] * num_devices
    for e in compute:
        busy[e.device] += e.end - e.start
    eff = sum(busy) / (makespan * num_devices) if makespan > 0 else 1.0
    return SimResult(
        makespan_ms=makespan,
        busy_ms=busy,
        bubble_ratio=1.0 - eff,
        efficiency=eff,
        events=events,
        jobs=jobs,
        iteration_ms=makespan / iterations,
    )


def simulate(
    plan: ModelExecutePlan,
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    num_devices: int,
    num_microbatch: int,
    run_type: str = "fused",
    re_ms: Sequence[float] | None = None,
    upload_ms: Sequence[float] | float | None = None,
    activation_ms: float = 0.0,
    policy: str = "roundrobin",
    bound_schedule: str = "1f1b",
    iterations: int = 1,
    overlap_iterations: bool = False,
    step_ms: float = 0.0,
) -> SimResult:
    """Simulate one iteration (or several) of ``plan``.

    Args:
        plan: the execution plan (validated here for ``run_type``).
        fwd_ms: forward time per layer and microbatch.
        bwd_ms: backward time per layer and microbatch (without recompute).
        num_devices: devices in the pool.
        num_microbatch: microbatches per iteration.
        run_type: "infer", "train" or "fused".
        re_ms: recompute time per layer and microbatch; default the forward time.
        upload_ms: parameter upload time per layer (a number = the same for every
            layer); a stage's upload is the sum over its layers. Round-robin only.
        activation_ms: latency of handing one microbatch's activations or gradients
            to a stage on another device.
        policy: "roundrobin" (RoundPipe: the schedule's devices) or "bound"
            (weight binding: backward-plan stages fixed on devices, see module doc).
        bound_schedule: "1f1b" (needs at most one stage per device) or "gpipe".
        iterations: iterations to simulate back to back.
        overlap_iterations: round-robin only — let the next iteration start on a
            device as soon as that device is free, as the one-step-stale asynchronous
            update allows, instead of after the whole previous iteration. This models
            ``forward_backward(blocking=False)``: round-robin continues from one
            iteration to the next, iteration ``it`` reads the weights of step ``it - 2``
            (so it waits for iteration ``it - 2`` and that step), and its upload of a layer
            waits until iteration ``it - 1`` has uploaded that layer (the host copy is
            overwritten only then). Uploads follow the engine's prefetch: during the
            previous job of the same iteration on that device if the weights are ready
            then, else when the job itself is due; never across iterations.
        step_ms: time of one optimizer step on the host. Step k starts when iteration k
            and step k - 1 are done; an iteration needs the step two before it.

    Returns:
        A :class:`SimResult`.
    """
    n = len(fwd_ms)
    if len(bwd_ms) != n:
        raise ValueError(f"bwd_ms has {len(bwd_ms)} entries but fwd_ms has {n}")
    fwd = _per_layer(fwd_ms, n, "fwd_ms")
    bwd = _per_layer(bwd_ms, n, "bwd_ms")
    re = _per_layer(re_ms, n, "re_ms") if re_ms is not None else list(fwd)
    upl = _per_layer(upload_ms, n, "upload_ms")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    if not activation_ms >= 0:
        raise ValueError(f"activation_ms must be >= 0, got {activation_ms!r}")
    plan.check_valid(n, run_type, num_devices)
    if policy == "bound":
        return _simulate_bound(
            plan,
            fwd,
            bwd,
            re,
            num_devices,
            num_microbatch,
            run_type,
            activation_ms,
            bound_schedule,
            iterations,
        )
    if not step_ms >= 0:
        raise ValueError(f"step_ms must be >= 0, got {step_ms!r}")
    jobs = build_schedule(plan, run_type, num_devices, num_microbatch)
    events: list[SimEvent] = []
    gate = _WeightGate(num_devices) if overlap_iterations else None
    step_ends: list[float] = []
    device_free = [0.0] * num_devices
    upload_free = [0.0] * num_devices
    # End times of the last two jobs per device: a prefetch may start once the job
    # before the previous one released its parameters.
    job_ends: list[list[float]] = [[] for _ in range(num_devices)]
    iter_ends: list[float] = []
    all_jobs: list[Job] = []
    for it in range(iterations):
        start_device = (it * len(jobs)) % num_devices if overlap_iterations else 0
        sched = build_schedule(
            plan, run_type, num_devices, num_microbatch, start_device=start_device
        )
        all_jobs += sched
        # One-step-stale update: iteration it uses the weights of step it - 2 (the step
        # after iteration it - 2), so it may start once that step is done.
        barrier = step_ends[it - 2] if it >= 2 else 0.0
        if not overlap_iterations:
            barrier = max([barrier] + iter_ends[-1:])
        ends = _run_iteration(
            sched,
            plan,
            run_type,
            fwd,
            bwd,
            re,
            upl,
            activation_ms,
            barrier,
            it,
            device_free,
            upload_free,
            job_ends,
            events,
            gate,
        )
        iter_ends.append(max([ends] + iter_ends))
        step_ends.append(max([iter_ends[-1]] + step_ends[-1:]) + step_ms)
    return _finish(events, num_devices, all_jobs, iterations)


def makespan_ms(
    plan: ModelExecutePlan,
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    num_devices: int,
    num_microbatch: int,
    run_type: str = "fused",
    re_ms: Sequence[float] | None = None,
) -> float:
    """Round-robin iteration time only, as :func:`simulate` computes it but without
    building the timeline (the planner calls this for its candidates)."""
    n = len(fwd_ms)
    fwd = [float(x) for x in fwd_ms]
    bwd = [float(x) for x in bwd_ms]
    re = [float(x) for x in re_ms] if re_ms is not None else fwd
    jobs = build_schedule(plan, run_type, num_devices, num_microbatch)
    return _run_iteration(
        jobs,
        plan,
        run_type,
        fwd,
        bwd,
        re,
        [0.0] * n,
        0.0,
        0.0,
        0,
        [0.0] * num_devices,
        [0.0] * num_devices,
        [[] for _ in range(num_devices)],
        None,
    )


def _stage_time(job: Job, fwd: list[float], bwd: list[float], re: list[float]) -> float:
    if job.kind == FORWARD:
        return sum(fwd[i] for i in job.layers)
    if job.kind == FUSED:
        return sum(fwd[i] + bwd[i] for i in job.layers)
    return sum(re[i] + bwd[i] for i in job.layers)


class _WeightGate:
    """Per-layer weight versions of overlapped iterations (the engine's WeightVersions):
    when each layer was last uploaded by the previous iteration, and which iteration the
    last job on each device belonged to (prefetch never crosses iterations)."""

    def __init__(self, num_devices: int) -> None:
        self.prev: dict[
            int, float
        ] = {}  # layer -> end of its last upload in the previous iteration
        self.cur: dict[int, float] = {}
        self.last_iter = [-1] * num_devices

    def next_iteration(self) -> None:
        self.prev, self.cur = self.cur, {}

    def upload_start(self, job: Job, it: int, job_ends: list[float], barrier: float) -> float:
        d = job.device
        prev1 = job_ends[-1] if job_ends else 0.0
        same = self.last_iter[d] == it
        # prefetched while the previous job of this iteration runs, else due at its own start
        due = (job_ends[-2] if len(job_ends) >= 2 else 0.0) if same else prev1
        opens = max([barrier] + [self.prev.get(i, 0.0) for i in job.layers])
        if opens > due:  # weights not published at prefetch time: uploaded when the job is due
            due = max(prev1, opens)
        self.last_iter[d] = it
        return due

    def uploaded(self, job: Job, end: float) -> None:
        for i in job.layers:
            self.cur[i] = max(self.cur.get(i, 0.0), end)


def _run_iteration(
    jobs: list[Job],
    plan: ModelExecutePlan,
    run_type: str,
    fwd: list[float],
    bwd: list[float],
    re: list[float],
    upl: list[float],
    act: float,
    barrier: float,
    it: int,
    device_free: list[float],
    upload_free: list[float],
    job_ends: list[list[float]],
    events: list[SimEvent] | None,
    gate: _WeightGate | None = None,
) -> float:
    """Time one iteration's jobs in launch order (every dependency points backwards).

    ``events=None`` only computes the end time (the planner's fast path); ``gate``
    adds the per-layer weight-version rule of overlapped iterations."""
    if gate is not None:
        gate.next_iteration()
    fwd_jobs: list[Job] = [j for j in jobs if j.kind == FORWARD]
    fwd_starts = [j.layers.start for j in fwd_jobs]
    end: dict[tuple[int, int], float] = {}  # (job index, microbatch) -> end time
    bwd_job_of_stage: dict[int, Job] = {}
    forward_done = barrier
    last = barrier
    for job in jobs:
        d = job.device
        dur = _stage_time(job, fwd, bwd, re)
        # Parameter upload, prefetched on the device's copy channel.
        params_ready = barrier
        up = sum(upl[i] for i in job.layers)
        if gate is not None:
            ustart = max(upload_free[d], gate.upload_start(job, it, job_ends[d], barrier))
            upload_free[d] = ustart + up
            params_ready = ustart + up
            gate.uploaded(job, ustart + up)
            if up > 0 and events is not None:
                events.append(
                    SimEvent(d, "upload", job.stage, -1, ustart, ustart + up, job.index, it)
                )
        elif up > 0:
            prev2 = job_ends[d][-2] if len(job_ends[d]) >= 2 else 0.0
            ustart = max(upload_free[d], prev2, barrier)
            upload_free[d] = ustart + up
            params_ready = ustart + up
            if events is not None:
                events.append(
                    SimEvent(d, "upload", job.stage, -1, ustart, ustart + up, job.index, it)
                )
        if job.kind != FORWARD:
            bwd_job_of_stage[job.stage] = job
        saved_from: Job | None = None
        if job.kind == BACKWARD and job.layers.start > 0 and fwd_jobs:
            # The forward job that ran the layer just below this stage saved its input.
            k = bisect.bisect_right(fwd_starts, job.layers.start - 1) - 1
            saved_from = fwd_jobs[k]
        for m in job.microbatches:
            ready = max(device_free[d], params_ready, barrier)
            prev: Job | None = None
            if job.kind == FORWARD:
                if job.stage > 0:
                    prev = fwd_jobs[job.stage - 1]
            elif job.stage == 0:
                if run_type == "fused" and fwd_jobs:
                    prev = fwd_jobs[-1]
                elif run_type == "train":
                    ready = max(ready, forward_done)
            else:
                prev = bwd_job_of_stage[job.stage - 1]
            if prev is not None:
                ready = max(ready, end[prev.index, m] + (act if prev.device != d else 0.0))
            if saved_from is not None:
                ready = max(ready, end[saved_from.index, m])
            finish = ready + dur
            end[job.index, m] = finish
            device_free[d] = finish
            if events is not None:
                events.append(SimEvent(d, job.kind, job.stage, m, ready, finish, job.index, it))
            last = max(last, finish)
            if job.kind == FORWARD:
                forward_done = max(forward_done, finish)
        job_ends[d].append(device_free[d])
    return last


# -- weight-bound baseline -------------------------------------------------------------


def _simulate_bound(
    plan: ModelExecutePlan,
    fwd: list[float],
    bwd: list[float],
    re: list[float],
    num_devices: int,
    num_microbatch: int,
    run_type: str,
    act: float,
    schedule: str,
    iterations: int,
) -> SimResult:
    if schedule not in BOUND_SCHEDULES:
        raise ValueError(f"bound_schedule must be one of {BOUND_SCHEDULES}, got {schedule!r}")
    stages = list(reversed(plan.bwd_plan)) if run_type != "infer" else list(plan.fwd_plan)
    return simulate_bound_stages(
        stages,
        fwd,
        bwd,
        num_devices,
        num_microbatch,
        re_ms=re,
        backward=run_type != "infer",
        fused_last=run_type == "fused",
        activation_ms=act,
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
    fwd = _per_layer(fwd_ms, n, "fwd_ms")
    bwd = _per_layer(bwd_ms, n, "bwd_ms")
    re = _per_layer(re_ms, n, "re_ms") if re_ms is not None else list(fwd)
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
    return _finish(events, num_devices, [], iterations)


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
                        "forward" if kind == "F" else "backward",
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
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    sums = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})

    def pack(cap: float) -> list[range] | None:
        out, j = [], n
        slack = cap + 1e-9 * abs(cap) + 1e-12
        while j > 0:
            i = bisect.bisect_left(prefix, prefix[j] - slack, 0, j)
            if i >= j:
                return None
            out.append(range(i, j))
            j = i
            if len(out) > num_stages:
                return None
        return list(reversed(out))

    lo, hi = 0, len(sums) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if pack(sums[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    result = pack(sums[lo])
    assert result is not None
    return result
