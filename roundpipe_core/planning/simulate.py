"""Event simulator of a plan on N devices: it times the job list of
:func:`~roundpipe_core.planning.schedule.build_schedule` (what the runtime executes) with
the engine's rules. Each device runs its jobs in launch order, a job its microbatches in
order; stage k of microbatch m waits for stage k-1 of microbatch m, and a backward stage
also for the saved input its first layer's forward produced; "train" starts its backward
phase after the whole forward phase; an upload runs on its device's copy channel,
prefetched while the previous job runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..kinds import JobKind, RunType, check_flag, check_int, parse_kind
from .plan import ModelExecutePlan
from .profile import LayerProfile
from .schedule import BACKWARD, FORWARD, FUSED, Job, build_schedule, jobs_by_device

__all__ = [
    "SimEvent",
    "SimResult",
    "OVERLAP_ITERATIONS",
    "SHARED_CORES_SLOWDOWN",
    "device_peak_bytes",
    "job_ms",
    "per_layer",
    "simulate",
    "simulated_iteration_ms",
    "summarize",
]


@dataclass(frozen=True)
class SimEvent:
    """One interval on a device's timeline (ms). ``kind``: "forward", "fused", "backward" or
    "upload"; ``microbatch`` -1 for uploads; ``job``: index in the schedule (-1: none)."""

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
        bubble_ratio / efficiency: ``1 -`` / ``sum(busy_ms) / (makespan_ms * devices)``.
        events: the timeline, compute and upload intervals; ``jobs``: the schedule timed.
        iteration_ms: makespan divided by the number of iterations simulated.
        peak_bytes: per device, the most memory it holds at once
            (:func:`device_peak_bytes`); empty unless given layer sizes.
    """

    makespan_ms: float
    busy_ms: list[float]
    bubble_ratio: float
    efficiency: float
    events: list[SimEvent] = field(repr=False)
    jobs: list[Job] = field(default_factory=list, repr=False)
    iteration_ms: float = 0.0
    peak_bytes: list[float] = field(default_factory=list)

    def timeline(self, width: int = 80) -> str:
        """ASCII rendering of the compute intervals, one row per device."""
        if self.makespan_ms <= 0:
            return ""
        rows = []
        scale = width / self.makespan_ms
        for d in range(len(self.busy_ms)):
            row = [" "] * width
            for e in self.events:
                if e.device != d or e.kind == "upload":
                    continue
                ch = JobKind(e.kind).code
                a = min(width - 1, int(e.start * scale))
                b = max(a + 1, min(width, int(round(e.end * scale))))
                row[a:b] = [ch] * (b - a)
            rows.append(f"dev{d} |" + "".join(row) + "|")
        return "\n".join(rows)


def per_layer(values: Sequence[float] | float | None, n: int, name: str) -> list[float]:
    """One float >= 0 per layer from a sequence, one number for all, or ``None`` (zeros)."""
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


def summarize(
    events: list[SimEvent], num_devices: int, jobs: list[Job], iterations: int
) -> SimResult:
    """Summarise a timeline: makespan, busy time and bubbles per device."""
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
    run_type: RunType | str = RunType.FUSED,
    re_ms: Sequence[float] | None = None,
    upload_ms: Sequence[float] | float | None = None,
    activation_ms: float = 0.0,
    iterations: int = 1,
    overlap_iterations: bool = False,
    step_ms: float = 0.0,
    param_bytes: Sequence[float] | None = None,
    grad_bytes: Sequence[float] | None = None,
    act_bytes: Sequence[float] | None = None,
    step_per_layer: bool = False,
    step_share: Sequence[float] | None = None,
    concurrent: bool = True,
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
            layer); a stage's upload is the sum over its layers.
        activation_ms: latency of handing one microbatch's activations or gradients
            to a stage on another device.
        iterations: iterations to simulate back to back.
        overlap_iterations: model ``forward_backward(blocking=False)``: the next
            iteration starts on a device as soon as it is free, iteration ``it`` reads the
            weights of step ``it - 2``, and its upload of a layer waits for iteration
            ``it - 1``'s; uploads are never prefetched across iterations.
        step_ms: one optimizer step on one host thread; step k starts when iteration k
            and step k - 1 are done; a job of iteration k + 2 waits for its layers only.
        step_per_layer: a layer's share of ``step_ms`` runs once its last gradient is in
            (a layer-wise step). Default: one call after the iteration.
        step_share: each layer's share of ``step_ms`` (normalized; default: in
            proportion to ``param_bytes`` if given, else equal).
        param_bytes: bytes a stage upload moves per layer; with it the result reports
            each device's peak memory (``SimResult.peak_bytes``).
        grad_bytes: gradient bytes per layer held by backward/fused stages; default
            ``param_bytes``.
        act_bytes: one microbatch's saved-activation bytes per layer, held while a
            backward or fused stage runs it.
        concurrent: whether the devices compute at the same time (GPUs); ``False``: one
            job at a time (CPU workers), the iteration takes the sum of its jobs.

    Returns:
        A :class:`SimResult`.
    """
    n = len(fwd_ms)
    fwd = per_layer(fwd_ms, n, "fwd_ms")
    bwd = per_layer(bwd_ms, n, "bwd_ms")
    re = per_layer(re_ms, n, "re_ms") if re_ms is not None else list(fwd)
    upl = per_layer(upload_ms, n, "upload_ms")
    check_int(iterations, "iterations")
    for name, value in (("activation_ms", activation_ms), ("step_ms", step_ms)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    check_flag(concurrent, "concurrent")
    rt = parse_kind(RunType, run_type, "run_type")
    plan.check_valid(n, rt, num_devices)
    events: list[SimEvent] = []
    gate = _WeightGate(num_devices) if overlap_iterations else None
    devices = _Devices(
        num_devices, rt, fwd, bwd, re, upl, activation_ms, not concurrent, events, gate
    )
    share = _step_shares(step_share if step_share is not None else param_bytes, n)
    step_ends: list[float] = []
    # per step: when each layer's new weights are published
    published: list[list[float]] = []
    opt_free = 0.0  # the optimizer thread
    iter_ends: list[float] = []
    all_jobs: list[Job] = []
    for it in range(iterations):
        start_device = len(all_jobs) % num_devices if overlap_iterations else 0
        sched = build_schedule(plan, rt, num_devices, num_microbatch, start_device=start_device)
        all_jobs += sched
        # One-step-stale update: iteration it uses the weights of step it - 2 (the step
        # after iteration it - 2): a job may start once its layers hold them.
        layer_ready = published[it - 2] if it >= 2 else None
        barrier = 0.0
        if not overlap_iterations:
            barrier = max([step_ends[it - 2] if it >= 2 else 0.0] + iter_ends[-1:])
        grad_done: dict[int, float] = {}
        ends = devices.run(sched, barrier, it, layer_ready, grad_done)
        iter_ends.append(max([ends] + iter_ends))
        ready = [0.0] * n
        if step_per_layer:
            # one thread, steps in order: this step's layers as their gradients complete
            for i in sorted(range(n), key=lambda i: (grad_done.get(i, iter_ends[-1]), -i)):
                opt_free = max(opt_free, grad_done.get(i, iter_ends[-1])) + step_ms * share[i]
                ready[i] = opt_free
        else:
            opt_free = max(opt_free, iter_ends[-1]) + step_ms
            ready = [opt_free] * n
        published.append(ready)
        step_ends.append(opt_free)
    result = summarize(events, num_devices, all_jobs, iterations)
    if param_bytes is not None:
        result.peak_bytes = device_peak_bytes(
            all_jobs, num_devices, param_bytes, grad_bytes, act_bytes
        )
    return result


def device_peak_bytes(
    jobs: Sequence[Job],
    num_devices: int,
    param_bytes: Sequence[float],
    grad_bytes: Sequence[float] | None = None,
    act_bytes: Sequence[float] | None = None,
) -> list[float]:
    """Peak memory of each device running ``jobs``: the running stage (with gradients and
    one microbatch's activations unless a forward) and its next job's parameters."""
    n = len(param_bytes)
    params = per_layer(param_bytes, n, "param_bytes")
    grads = per_layer(grad_bytes, n, "grad_bytes") if grad_bytes is not None else params
    acts = per_layer(act_bytes, n, "act_bytes")
    peak = [0.0] * num_devices
    for d, queue in enumerate(jobs_by_device(list(jobs), num_devices)):
        for k, job in enumerate(queue):
            held = sum(params[i] for i in job.layers)
            if job.kind != FORWARD:
                held += sum(grads[i] + acts[i] for i in job.layers)
            if k + 1 < len(queue):
                held += sum(params[i] for i in queue[k + 1].layers)
            peak[d] = max(peak[d], held)
    return peak


#: Iterations per window when measuring the steady state of overlapped iterations.
OVERLAP_ITERATIONS = 4


#: What a stage costs on a CPU worker computing beside another (``pool.cpu_overlap``),
#: with half of the cores as intra-op threads, relative to the same stage alone on all
#: of them: measured on a 2-core host, forward + backward of 16 x Linear(1024) on 64
#: rows (0.105 s a pass on 1 thread beside another, 0.070 s alone on 2).
SHARED_CORES_SLOWDOWN = 1.5


def simulated_iteration_ms(
    plan: ModelExecutePlan,
    profile: LayerProfile,
    run_type: RunType | str,
    num_devices: int,
    num_microbatch: int,
    overlap: bool = False,
    concurrent: bool = True,
    shared_cores: bool = False,
    replicated: bool = False,
) -> float:
    """The planner's one iteration-time estimate, on one of three device models:

    * ``concurrent=True`` (GPUs): devices compute side by side; with ``overlap``
      ("fused") the steady state of overlapped calls over :data:`OVERLAP_ITERATIONS`.
    * ``concurrent=False`` (CPU workers under one lock): every job's time adds up.
    * ``shared_cores=True`` (overlapping CPU workers): jobs on several workers at once
      each run :data:`SHARED_CORES_SLOWDOWN` times slower. ``replicated``: the one-stage
      plan as one job per worker (``planner.fused_replicas``).
    """
    run_type = parse_kind(RunType, run_type, "run_type")
    f = 1.0  # how much slower each job runs
    if shared_cores:
        jobs = len(plan.fwd_plan) + len(plan.bwd_plan)
        f, overlap = SHARED_CORES_SLOWDOWN, False
        if jobs == 1 and replicated and num_devices > 1 and num_microbatch > 1:
            alone = simulated_iteration_ms(plan, profile, run_type, 1, 1, concurrent=False)
            return alone * f * -(-num_microbatch // min(num_devices, num_microbatch))
        concurrent = jobs > 1 and num_devices > 1
    if not concurrent:  # one job computes at a time: nothing overlaps or shares cores
        overlap, f = False, 1.0
    if not overlap or run_type != RunType.FUSED:
        fwd, re, bwd = ([t * f for t in ms] for ms in profile.layer_ms())
        sched = build_schedule(plan, run_type, num_devices, num_microbatch)
        return _Devices(num_devices, run_type, fwd, bwd, re, serial=not concurrent).run(sched)

    def span(iterations: int) -> float:
        return simulate(
            plan,
            profile.fwd_ms,
            profile.bwd_ms,
            num_devices,
            num_microbatch,
            run_type=run_type,
            re_ms=profile.re_ms,
            iterations=iterations,
            overlap_iterations=True,
        ).makespan_ms

    # Overlapped iterations can settle into a period of several iterations: measure a
    # whole window after a warm-up window of the same length.
    k = OVERLAP_ITERATIONS
    return (span(2 * k) - span(k)) / k


def _step_shares(weights: Sequence[float] | None, n: int) -> list[float]:
    """Each layer's share of the step time (summing to 1)."""
    if weights is None:
        return [1.0 / n] * n
    w = per_layer(weights, n, "step_share")  # (each >= 0)
    total = sum(w)
    if total <= 0:
        raise ValueError(f"step_share must have a positive sum, got {w}")
    return [x / total for x in w]


def job_ms(job: Job, fwd: list[float], bwd: list[float], re: list[float]) -> float:
    """One microbatch of ``job``: forward, forward + backward (fused), or recompute +
    backward, summed over its layers."""
    if job.kind == FORWARD:
        return sum(fwd[i] for i in job.layers)
    if job.kind == FUSED:
        return sum(fwd[i] + bwd[i] for i in job.layers)
    return sum(re[i] + bwd[i] for i in job.layers)


class _WeightGate:
    """Per-layer weight versions of overlapped iterations: when the previous iteration
    last uploaded each layer (``prev``), and each device's last job's iteration."""

    def __init__(self, num_devices: int) -> None:
        self.prev: dict[int, float] = {}
        self.cur: dict[int, float] = {}
        self.last_iter = [-1] * num_devices

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


class _Devices:
    """The devices iterations are timed on (per-layer ms, ``upl``: upload ms, ``act``:
    activation hand-over latency), with their state carried from one iteration to the
    next: when each device and its copy channel are free, and its jobs' end times (a
    prefetch may start once the job before the previous one released its parameters).
    ``serial``: one compute unit for all devices (CPU workers under one lock);
    ``events=None`` only computes the ends (the planner's fast path); ``gate``:
    overlapped iterations' weight versions."""

    def __init__(
        self,
        num_devices: int,
        run_type: RunType,
        fwd: list[float],
        bwd: list[float],
        re: list[float],
        upl: list[float] | None = None,
        act: float = 0.0,
        serial: bool = False,
        events: list[SimEvent] | None = None,
        gate: _WeightGate | None = None,
    ) -> None:
        self.run_type = run_type
        self.fwd = fwd
        self.bwd = bwd
        self.re = re
        self.upl = upl or [0.0] * len(fwd)
        self.act = act
        self.serial = serial
        self.events = events
        self.gate = gate
        self.device_free = [0.0] * num_devices
        self.upload_free = [0.0] * num_devices
        self.job_ends: list[list[float]] = [[] for _ in range(num_devices)]

    def run(
        self,
        jobs: list[Job],
        barrier: float = 0.0,
        it: int = 0,
        layer_ready: list[float] | None = None,
        grad_done: dict[int, float] | None = None,
    ) -> float:
        """Time one iteration's jobs in launch order; returns its end. ``layer_ready``:
        when each layer's weights are published; ``grad_done`` receives when each
        layer's gradients are complete."""
        gate, events, device_free = self.gate, self.events, self.device_free
        if gate is not None:
            gate.prev, gate.cur = gate.cur, {}
        fwd_jobs: list[Job] = [j for j in jobs if j.kind == FORWARD]
        fwd_starts = [j.layers.start for j in fwd_jobs]
        end: dict[int, list[float]] = {}  # job index -> end time of each of its microbatches
        bwd_job_of_stage: dict[int, Job] = {}
        forward_done = barrier
        last = barrier
        outer = barrier
        for job in jobs:
            d = job.device
            dur = job_ms(job, self.fwd, self.bwd, self.re)
            if layer_ready is not None:  # this job's layers hold the weights it reads
                barrier = max([outer] + [layer_ready[i] for i in job.layers])
            # Parameter upload, prefetched on the device's copy channel.
            params_ready = barrier
            up = sum(self.upl[i] for i in job.layers)
            if gate is not None or up > 0:
                if gate is not None:
                    due = gate.upload_start(job, it, self.job_ends[d], barrier)
                else:
                    due = max(self.job_ends[d][-2] if len(self.job_ends[d]) >= 2 else 0.0, barrier)
                ustart = max(self.upload_free[d], due)
                params_ready = self.upload_free[d] = ustart + up
                if gate is not None:
                    gate.uploaded(job, params_ready)
                if up > 0 and events is not None:
                    events.append(
                        SimEvent(d, "upload", job.stage, -1, ustart, params_ready, job.index, it)
                    )
            if job.kind != FORWARD:
                bwd_job_of_stage[job.stage] = job
            saved_from: Job | None = None
            if job.kind == BACKWARD and job.layers.start > 0 and fwd_jobs:
                # The forward job that ran the layer just below this stage saved its input.
                k = bisect.bisect_right(fwd_starts, job.layers.start - 1) - 1
                saved_from = fwd_jobs[k]
            prev: Job | None = None
            start = max(max(device_free) if self.serial else device_free[d], params_ready, barrier)
            if job.kind == FORWARD:
                if job.stage > 0:
                    prev = fwd_jobs[job.stage - 1]
            elif job.stage == 0:
                if self.run_type == RunType.FUSED and fwd_jobs:
                    prev = fwd_jobs[-1]
                elif self.run_type == RunType.TRAIN:
                    start = max(start, forward_done)
            else:
                prev = bwd_job_of_stage[job.stage - 1]
            # Every job of a schedule runs the same microbatches in the same order, so a
            # dependency's end times line up with this job's by position.
            prev_ends = end[prev.index] if prev is not None else None
            delay = self.act if prev is not None and prev.device != d else 0.0
            saved_ends = end[saved_from.index] if saved_from is not None else None
            t = start
            ends: list[float] = []
            for pos, m in enumerate(job.microbatches):
                ready = t
                if prev_ends is not None and prev_ends[pos] + delay > ready:
                    ready = prev_ends[pos] + delay
                if saved_ends is not None and saved_ends[pos] > ready:
                    ready = saved_ends[pos]
                t = ready + dur
                ends.append(t)
                if events is not None:
                    events.append(SimEvent(d, str(job.kind), job.stage, m, ready, t, job.index, it))
            end[job.index] = ends
            if grad_done is not None and job.kind != FORWARD:
                for i in job.layers:
                    grad_done[i] = max(grad_done.get(i, 0.0), t)
            device_free[d] = t
            last = max(last, t)
            if job.kind == FORWARD:
                forward_done = max(forward_done, t)
            self.job_ends[d].append(t)
        return last
