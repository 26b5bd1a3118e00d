"""What the simulator returns: timeline events and the iteration's summary.

Shared by the round-robin simulator (:mod:`roundpipe_core.planning.simulate`) and the
weight-bound baseline (:mod:`roundpipe_core.planning.baseline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kinds import JobKind
from .schedule import Job

__all__ = ["SimEvent", "SimResult", "summarize", "per_layer"]


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
        peak_bytes: per device, the most memory it holds at once: the running stage
            (parameters; backward and fused stages also their gradients and one
            microbatch's saved activations) plus the next stage's prefetched
            parameters. Empty unless the simulation was given layer sizes.
    """

    makespan_ms: float
    busy_ms: list[float]
    bubble_ratio: float
    efficiency: float
    events: list[SimEvent] = field(repr=False)
    jobs: list[Job] = field(default_factory=list, repr=False)
    iteration_ms: float = 0.0
    peak_bytes: list[float] = field(default_factory=list)

    def chrome_trace(self) -> dict[str, Any]:
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
                ch = JobKind(e.kind).code
                a = min(width - 1, int(e.start * scale))
                b = max(a + 1, min(width, int(round(e.end * scale))))
                for x in range(a, b):
                    row[x] = ch
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
