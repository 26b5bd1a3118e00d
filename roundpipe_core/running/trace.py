"""Timelines of pipelined calls in Chrome's trace-event format (Perfetto, chrome://tracing):
the one trace writer, of measured and of simulated iterations alike.

A timeline is a flat list of :class:`Span` records, from a real call
(:func:`spans_from_call`, :func:`spans_from_roundpipe`) or from the simulator
(:func:`spans_from_simulation`), converted alike so that both open side by side with
the same rows; :func:`chrome_trace` makes the trace-event object, one row per device
lane.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..kinds import JobKind, check_int

if TYPE_CHECKING:  # the simulator is only read here, never needed at import time
    from ..planning.simulate import SimResult

__all__ = [
    "LANES",
    "Span",
    "chrome_trace",
    "job_name",
    "merge_traces",
    "row_name",
    "rows_of",
    "side_by_side_trace",
    "spans_from_call",
    "spans_from_roundpipe",
    "spans_from_simulation",
    "write_trace",
]

#: The lanes of a device, in the order their rows appear under it.
LANES: tuple[str, ...] = ("compute", "upload", "activation", "gradient", "optimizer")

# Rows of one device take len(LANES) consecutive thread ids; host rows (device None)
# start at _HOST_TID so they sort after every device.
_HOST_TID = 1_000_000


@dataclass(frozen=True)
class Span:
    """One interval on a timeline.

    Attributes:
        device: index of the device in the pool; ``None`` for host work (the step).
        lane: one of :data:`LANES`: a job's stage, parameters to the device, transfers
            between stages, the optimizer step.
        name: what ran, e.g. ``"2F0"`` for a job (stage, kind code, device).
        start_s / end_s: seconds (any origin), ``start_s <= end_s``.
        args: extra fields for the viewer; compute spans carry ``kind``, ``stage``,
            ``layers``, ``microbatches`` and ``job``.
    """

    device: int | None
    lane: str
    name: str
    start_s: float
    end_s: float
    args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lane not in LANES:
            raise ValueError(f"Span.lane must be one of {LANES}; got {self.lane!r}")
        if self.device is not None:
            check_int(self.device, "Span.device", minimum=0, why="a device index, or None (host)")
        if not isinstance(self.name, str):
            raise TypeError(f"Span.name must be a str; got {type(self.name).__name__}")
        for what, value in (("start_s", self.start_s), ("end_s", self.end_s)):
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Span.{what} must be a finite number of seconds; got {value!r}")
        if self.end_s < self.start_s:
            raise ValueError(
                f"Span {self.name!r} ends before it starts ({self.end_s!r} < {self.start_s!r}); "
                "pass start_s <= end_s"
            )

    @property
    def duration_s(self) -> float:
        """``end_s - start_s``."""
        return self.end_s - self.start_s

    @property
    def kind(self) -> str:
        """The span's colour and trace category: a compute span's job kind, else the lane."""
        if self.lane == "compute":
            return str(self.args.get("kind", "compute"))
        return self.lane


def job_name(job: Any) -> str:
    """The text form of a job (anything with ``stage``, ``kind``, ``device``): ``"2F0"``."""
    return f"{job.stage}{JobKind(str(job.kind)).code}{job.device}"


def _range_text(r: range) -> str:
    if len(r) == 0:
        return "-"
    return f"{r.start}" if len(r) == 1 else f"{r.start}-{r[-1]}"


def _job_args(job: Any) -> dict[str, Any]:
    return {
        "kind": str(job.kind),
        "stage": int(job.stage),
        "layers": _range_text(job.layers),
        "microbatches": _range_text(job.microbatches),
        "job": int(job.index),
    }


def spans_from_call(timing: Any, steps: Iterable[tuple[float, float]] = ()) -> list[Span]:
    """The measured timeline of one pipelined call.

    Args:
        timing: the call's :class:`~roundpipe_core.running.timer.CallTiming`.
        steps: ``(start, end)`` seconds of optimizer steps; those that ended before the
            call's first job started belong to earlier calls and are left out, so an
            asynchronous step that overlaps the call shows beside it.

    Returns:
        A ``"compute"`` :class:`Span` per job that ran (:func:`job_name`, on the device
        that ran it), then the steps (host), then a span per transfer the workers waited on.
    """
    out = []
    for t in timing.jobs:
        args = _job_args(t.job)
        if t.device != t.job.device:
            # a job that ran elsewhere than its schedule says must stand out in the viewer
            args["scheduled_device"] = int(t.job.device)
        out.append(Span(t.device, "compute", job_name(t.job), t.start_s, t.end_s, args))
    first = min((s.start_s for s in out), default=-math.inf)
    out += [Span(None, "optimizer", "step", a, b) for a, b in steps if b >= first]
    return out + timing.transfers


def spans_from_roundpipe(rp: Any) -> list[Span]:
    """:func:`spans_from_call` of ``rp``'s last pipelined call (blocking or not) and the
    steps queued with ``rp.step()`` that ran during or after it."""
    return spans_from_call(rp.last_call, list(getattr(rp, "_step_spans", ())))


def spans_from_simulation(
    sim: SimResult, iteration: int | None = None, per_job: bool = True
) -> list[Span]:
    """The simulator's timeline as spans (milliseconds become seconds).

    Args:
        sim: a :class:`roundpipe_core.planning.simulate.SimResult`.
        iteration: only this iteration (negative counts from the last one, so ``-1``
            is the last); ``None`` keeps all.
        per_job: merge a job's microbatch events into one span from its first start
            to its last end, as a measured call records them. Events without a job
            (the weight-bound baseline) stay per microbatch.

    Returns:
        Spans sorted by start time: ``"compute"`` spans named like measured ones
        (``"2F0"``), ``"upload"`` spans named ``"up 2F0"``.
    """
    events = sim.events
    if iteration is not None:
        iterations = sorted({e.iteration for e in events})
        if not iterations:
            return []
        if not -len(iterations) <= iteration < len(iterations):
            raise ValueError(
                f"iteration={iteration} is out of range: the simulation has "
                f"{len(iterations)} iteration(s); pass 0..{len(iterations) - 1}, -1 or None"
            )
        keep = iterations[iteration]
        events = [e for e in events if e.iteration == keep]
    # Jobs of iteration k occupy sim.jobs[k * per_iter : (k + 1) * per_iter].
    jobs = sim.jobs
    total = max((e.iteration for e in sim.events), default=0) + 1
    per_iter = len(jobs) // total if jobs and len(jobs) % total == 0 else 0

    def job_of(e: Any) -> Any:
        if e.job < 0 or per_iter == 0:
            return None
        return jobs[e.iteration * per_iter + e.job]

    out: list[Span] = []
    groups: dict[Any, list[Any]] = {}
    for e in events:
        if e.kind == "upload":
            job = job_of(e)
            name = f"up {job_name(job)}" if job is not None else f"up s{e.stage}"
            args: dict[str, Any] = {"stage": e.stage, "job": e.job, "iteration": e.iteration}
            out.append(Span(e.device, "upload", name, e.start / 1e3, e.end / 1e3, args))
        else:  # a job's microbatches as one span (per_job), else each on its own
            key = (e.iteration, e.job) if per_job and e.job >= 0 else id(e)
            groups.setdefault(key, []).append(e)
    for evs in groups.values():
        e0 = evs[0]
        job = job_of(e0) if per_job else None
        if job is not None:
            args = _job_args(job)
        else:
            mbs = sorted(e.microbatch for e in evs)
            mb = _range_text(range(mbs[0], mbs[-1] + 1))
            args = {"kind": e0.kind, "stage": e0.stage, "microbatches": mb, "job": e0.job}
        args["iteration"] = e0.iteration
        start, end = min(e.start for e in evs) / 1e3, max(e.end for e in evs) / 1e3
        out.append(Span(e0.device, "compute", job_name(e0), start, end, args))
    out.sort(key=lambda s: (s.start_s, s.end_s))
    return out


def row_name(device: int | None, lane: str) -> str:
    """The row (thread) name of a device lane: ``"device 0"`` for compute,
    ``"device 0 upload"`` for another lane, ``"optimizer"`` / ``"host <lane>"`` on the host."""
    if device is None:
        return "optimizer" if lane == "optimizer" else f"host {lane}"
    return f"device {device}" if lane == "compute" else f"device {device} {lane}"


def rows_of(spans: Iterable[Span]) -> list[tuple[int | None, str]]:
    """The ``(device, lane)`` rows of ``spans`` in display order: device by device, a
    device's lanes in :data:`LANES` order, host rows (the optimizer) last."""
    return sorted({(s.device, s.lane) for s in spans}, key=lambda r: _tid(*r))


def _tid(device: int | None, lane: str) -> int:
    lane_index = LANES.index(lane)
    if device is None:
        return _HOST_TID + lane_index
    return 1 + device * len(LANES) + lane_index


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, range):
        return _range_text(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    return str(value)


def chrome_trace(
    spans: Sequence[Span],
    process_name: str = "RoundPipe (measured)",
    pid: int = 0,
    origin_s: float | None = None,
) -> dict[str, Any]:
    """A trace-event JSON object of ``spans``: a complete event (``"ph": "X"``) each, with
    ``ts``/``dur`` in microseconds from ``origin_s``; a thread per device lane, named by
    :func:`row_name`, in :func:`rows_of`'s order.

    Args:
        spans: the timeline; events keep this order.
        process_name: the name of the process row group (``"RoundPipe (simulated)"``
            for a simulation, so both can sit in one file, see :func:`merge_traces`).
        pid: the process id of every event.
        origin_s: the time that becomes ``ts = 0``; default the earliest start.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.
    """
    check_int(pid, "pid", minimum=0)
    bad = [s for s in spans if not isinstance(s, Span)]
    if bad:
        raise TypeError(
            f"chrome_trace takes Span records; got {type(bad[0]).__name__}. Convert a call's "
            "timing with spans_from_call() and simulations with spans_from_simulation()"
        )
    if origin_s is None:
        origin_s = min((s.start_s for s in spans), default=0.0)

    def meta(name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}

    rows = [meta("process_name", 0, {"name": process_name})]
    for order, (device, lane) in enumerate(rows_of(spans)):
        tid = _tid(device, lane)
        rows.append(meta("thread_name", tid, {"name": row_name(device, lane)}))
        rows.append(meta("thread_sort_index", tid, {"sort_index": order}))
    events = [
        {
            "name": s.name,
            "cat": s.kind,
            "ph": "X",
            "ts": (s.start_s - origin_s) * 1e6,
            "dur": (s.end_s - s.start_s) * 1e6,
            "pid": pid,
            "tid": _tid(s.device, s.lane),
            "args": _json_value(dict(s.args)),
        }
        for s in spans
    ]
    return {"traceEvents": rows + events, "displayTimeUnit": "ms"}


def merge_traces(*traces: Mapping[str, Any]) -> dict[str, Any]:
    """One trace holding the events of several (measured and simulated), each its own
    process group (``ValueError`` if two use the same ``pid``)."""
    events: list[Any] = []
    owner: dict[Any, int] = {}
    for k, trace in enumerate(traces):
        if not isinstance(trace, Mapping) or "traceEvents" not in trace:
            raise TypeError(f"trace {k} is not a trace-event object with 'traceEvents'")
        for pid in {e.get("pid") for e in trace["traceEvents"]}:
            if owner.setdefault(pid, k) != k:
                raise ValueError(
                    f"traces {owner[pid]} and {k} both use pid {pid!r}; give each trace its "
                    "own pid (chrome_trace(..., pid=1))"
                )
        events += list(trace["traceEvents"])
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def side_by_side_trace(
    measured: Sequence[Span], simulated: Sequence[Span] | None = None
) -> dict[str, Any]:
    """One trace with the measured timeline (process "RoundPipe (measured)", pid 0)
    and, if given, the simulated one ("RoundPipe (simulated)", pid 1) below it, each
    starting at 0 so the two line up in the viewer."""
    traces = [chrome_trace(measured, "RoundPipe (measured)", pid=0)]
    if simulated is not None:
        traces.append(chrome_trace(simulated, "RoundPipe (simulated)", pid=1))
    return merge_traces(*traces)


def write_trace(path: str | Path, trace: Mapping[str, Any]) -> Path:
    """Write ``trace`` as JSON to ``path`` (parent folders created); the path."""
    if not isinstance(trace, Mapping) or not isinstance(trace.get("traceEvents"), list):
        raise TypeError(
            "write_trace expects a trace-event object {'traceEvents': [...]}, e.g. from "
            "chrome_trace(spans)"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        json.dump(trace, f)
    return path
