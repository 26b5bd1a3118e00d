"""Chrome trace-event export of measured and simulated pipelined calls.

A measured call's record (``RoundPipe.last_call``), the simulator's events and
the timed optimizer steps become one kind of record (``Span``) and one trace
format: complete events with microsecond times, one named row per device lane,
rows named like the simulator's own trace so both open side by side.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from _util import mlp, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.planning.schedule import build_schedule
from roundpipe_core.planning.simulate import simulate
from roundpipe_core.running.trace import (
    LANES,
    Span,
    chrome_trace,
    job_name,
    merge_traces,
    row_name,
    side_by_side_trace,
    spans_from_call,
    spans_from_roundpipe,
    spans_from_simulation,
    write_trace,
)

# 6 layers, asymmetric: 2 forward stages, 4 backward stages
PLAN = ModelExecutePlan(
    [range(0, 3), range(3, 4)], [range(4, 6), range(2, 4), range(1, 2), range(0, 1)]
)


class _Sleep(nn.Module):
    """Makes a layer's compute long enough that the spans are well apart from timer noise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.001)
        return x


def _measured_run(devices: int = 3, calls: int = 2):
    """``calls`` non-blocking iterations with an optimizer step after each that times
    itself; returns the RoundPipe's last schedule, its compute spans, and the steps'
    own spans."""
    model = mlp()
    for i in range(len(model)):
        model[i] = nn.Sequential(model[i], _Sleep())
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=PLAN)
    rp = RoundPipe(model, devices=f"cpu:{devices}", model_run_config=cfg)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
    inner: list[Span] = []

    def step() -> None:
        start = time.perf_counter()
        opt.step()
        opt.zero_grad()
        inner.append(Span(None, "optimizer", "step", start, time.perf_counter()))

    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(calls):
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            pending = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
            pending.result(timeout=60)
            rp.step(step)
        rp.synchronize()
        # the engine times step() itself: its record of the last step encloses the
        # step's own; the step before may show too where it overlapped the last call
        own_steps = [s for s in spans_from_roundpipe(rp) if s.lane == "optimizer"]
        assert 1 <= len(own_steps) <= 2
        last = own_steps[-1]
        assert last.start_s <= inner[-1].start_s and last.end_s >= inner[-1].end_s
        compute = [s for s in spans_from_call(rp.last_call) if s.lane == "compute"]
        return list(rp.last_call.schedule), compute, inner
    finally:
        rp.close()


def _check_trace_format(trace: dict) -> None:
    """The trace-event rules a viewer relies on."""
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert complete and meta
    assert {e["ph"] for e in events} == {"X", "M"}
    for e in complete:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["ts"], float) and e["ts"] >= 0.0
        assert isinstance(e["dur"], float) and e["dur"] >= 0.0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    named = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} <= named, "a row has no thread_name"
    assert any(e["name"] == "process_name" for e in meta)


def test_real_run_trace_is_valid_and_orders_jobs(tmp_path):
    schedule, spans, steps = _measured_run()
    assert len(spans) == len(schedule) == 2 + 4
    assert len(steps) == 2 and all(s.lane == "optimizer" and s.device is None for s in steps)
    trace = chrome_trace(spans + steps[-1:])
    path = write_trace(tmp_path / "sub" / "measured.json", trace)
    loaded = json.loads(path.read_text())
    assert loaded == trace  # JSON round trip: only JSON types inside
    _check_trace_format(loaded)

    # Same jobs as the schedule, named by the job's text form, on the device that ran it.
    assert sorted(s.name for s in spans) == sorted(job_name(j) for j in schedule)
    by_name = {job_name(j): j for j in schedule}
    for s in spans:
        job = by_name[s.name]
        assert s.device == job.device and s.args["kind"] == job.kind
        assert s.args["layers"] == (
            f"{job.layers.start}-{job.layers[-1]}" if len(job.layers) > 1 else str(job.layers[0])
        )
        assert s.args["microbatches"] == "0-2"

    # A device runs its jobs one after another, in launch order: no overlap on a compute lane.
    for d in range(3):
        mine = sorted((s for s in spans if s.device == d), key=lambda s: s.start_s)
        assert mine, f"device {d} ran nothing"
        assert [s.args["job"] for s in mine] == sorted(s.args["job"] for s in mine)
        for a, b in zip(mine, mine[1:]):
            assert a.end_s <= b.start_s, f"{a.name} and {b.name} overlap on device {d}"

    # Times in microseconds from the earliest start; one row per device and the optimizer.
    x_events = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    origin = min(s.start_s for s in spans + steps[-1:])
    for e, s in zip(x_events, spans + steps[-1:]):  # events keep the order of the spans
        assert e["name"] == s.name
        assert e["ts"] == pytest.approx((s.start_s - origin) * 1e6, abs=1e-3)
        assert e["dur"] == pytest.approx(s.duration_s * 1e6, abs=1e-3)
    names = {
        e["tid"]: e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "thread_name"
    }
    assert sorted(names.values()) == ["device 0", "device 1", "device 2", "optimizer"]
    # The optimizer step of the last iteration runs after its gradients are in.
    assert steps[-1].start_s >= max(s.end_s for s in spans)
    sort_index = {
        e["tid"]: e["args"]["sort_index"]
        for e in loaded["traceEvents"]
        if e["name"] == "thread_sort_index"
    }
    rows = sorted(names, key=sort_index.__getitem__)
    assert [names[t] for t in rows] == ["device 0", "device 1", "device 2", "optimizer"]


def test_rows_match_the_simulator_trace():
    """Measured and simulated traces use the simulator's row names (device lanes)."""
    sim = simulate(PLAN, [1.0] * 6, [2.0] * 6, 3, 3, upload_ms=0.5)
    ours = chrome_trace(spans_from_simulation(sim), process_name="RoundPipe (simulated)")
    our_rows = {e["args"]["name"] for e in ours["traceEvents"] if e["name"] == "thread_name"}
    assert our_rows == {
        "device 0",
        "device 1",
        "device 2",
        "device 0 upload",
        "device 1 upload",
        "device 2 upload",
    }
    _check_trace_format(ours)


def test_simulation_spans_are_per_job_and_named_like_measured_ones():
    sim = simulate(PLAN, [1.0] * 6, [2.0] * 6, 2, 3, upload_ms=0.25)
    spans = spans_from_simulation(sim)
    compute = [s for s in spans if s.lane == "compute"]
    uploads = [s for s in spans if s.lane == "upload"]
    schedule = build_schedule(PLAN, "fused", 2, 3)
    assert sorted(s.name for s in compute) == sorted(job_name(j) for j in schedule)
    assert sorted(s.name for s in uploads) == sorted("up " + job_name(j) for j in schedule)
    for s in compute:  # a job's span runs from its first microbatch's start to its last's end
        evs = [e for e in sim.events if e.job == s.args["job"] and e.kind != "upload"]
        assert len(evs) == 3
        assert s.start_s == pytest.approx(min(e.start for e in evs) / 1e3)
        assert s.end_s == pytest.approx(max(e.end for e in evs) / 1e3)
    assert [s.start_s for s in spans] == sorted(s.start_s for s in spans)
    per_mb = spans_from_simulation(sim, per_job=False)
    assert len([s for s in per_mb if s.lane == "compute"]) == 3 * len(schedule)


def test_simulation_iteration_selects_one_iteration():
    sim = simulate(PLAN, [1.0] * 6, [2.0] * 6, 3, 3, iterations=3, overlap_iterations=True)
    last = spans_from_simulation(sim, iteration=-1)
    assert last and {s.args["iteration"] for s in last} == {2}
    assert len(last) == len(build_schedule(PLAN, "fused", 3, 3))
    assert {s.args["iteration"] for s in spans_from_simulation(sim)} == {0, 1, 2}
    # jobs of a later iteration are named after the devices they ran on there
    for s in last:
        assert s.name.endswith(str(s.device))
    with pytest.raises(ValueError, match="iteration=3 is out of range"):
        spans_from_simulation(sim, iteration=3)


def test_units_and_rows_of_hand_made_spans():
    spans = [
        Span(1, "compute", "0F1", 10.0, 10.5, {"kind": "forward", "layers": range(0, 3)}),
        Span(1, "gradient", "g", 10.5, 10.75),
        Span(0, "activation", "a", 10.25, 10.5),
        Span(None, "optimizer", "step", 11.0, 11.25),
    ]
    trace = chrome_trace(spans, pid=3)
    _check_trace_format(trace)
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in x] == [0.0, 500000.0, 250000.0, 1000000.0]
    assert [e["dur"] for e in x] == [500000.0, 250000.0, 250000.0, 250000.0]
    assert [e["cat"] for e in x] == ["forward", "gradient", "activation", "optimizer"]
    assert x[0]["args"]["layers"] == "0-2"  # ranges become JSON text
    assert {e["pid"] for e in trace["traceEvents"]} == {3}
    assert row_name(1, "gradient") == "device 1 gradient"
    assert row_name(None, "upload") == "host upload"
    assert len({e["tid"] for e in x}) == 4
    shifted = chrome_trace(spans, origin_s=9.0)
    assert [e["ts"] for e in shifted["traceEvents"] if e["ph"] == "X"][0] == 1000000.0


def test_merge_traces_keeps_both_processes_and_rejects_a_shared_pid():
    a = chrome_trace([Span(0, "compute", "0F0", 0.0, 1.0)], "RoundPipe (measured)", pid=0)
    b = chrome_trace([Span(0, "compute", "0F0", 0.0, 2.0)], "RoundPipe (simulated)", pid=1)
    merged = merge_traces(a, b)
    procs = {e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert procs == {"RoundPipe (measured)", "RoundPipe (simulated)"}
    _check_trace_format(merged)
    with pytest.raises(ValueError, match="both use pid 0"):
        merge_traces(a, a)


def test_side_by_side_trace_of_a_real_run_and_its_simulation(tmp_path):
    schedule, spans, _ = _measured_run(devices=2, calls=1)
    sim = simulate(PLAN, [1.0] * 6, [2.0] * 6, 2, 3)
    trace = side_by_side_trace(spans, spans_from_simulation(sim))
    _check_trace_format(json.loads(write_trace(tmp_path / "both.json", trace).read_text()))
    rows: dict[int, set[str]] = {}
    for e in trace["traceEvents"]:
        if e["name"] == "thread_name":
            rows.setdefault(e["pid"], set()).add(e["args"]["name"])
    assert rows == {0: {"device 0", "device 1"}, 1: {"device 0", "device 1"}}
    names = {
        p: {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == p}
        for p in (0, 1)
    }
    assert names[0] == {job_name(j) for j in schedule}
    assert names[1] == {job_name(j) for j in build_schedule(PLAN, "fused", 2, 3)}
    for p in (0, 1):  # both start at 0
        assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == p) == 0.0
    assert side_by_side_trace(spans)["traceEvents"][0]["args"]["name"] == "RoundPipe (measured)"


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"lane": "disk"}, ValueError, "Span.lane must be one of"),
        ({"device": -1}, ValueError, "Span.device must be an int >= 0"),
        ({"device": True}, ValueError, "Span.device must be an int >= 0"),
        ({"end_s": 0.5}, ValueError, "ends before it starts"),
        ({"start_s": float("nan")}, ValueError, "Span.start_s must be a finite"),
        ({"name": 3}, TypeError, "Span.name must be a str"),
    ],
)
def test_bad_spans_are_rejected(kwargs, exc, match):
    base = {"device": 0, "lane": "compute", "name": "0F0", "start_s": 1.0, "end_s": 2.0}
    with pytest.raises(exc, match=match):
        Span(**{**base, **kwargs})


def test_bad_inputs_name_the_fix(tmp_path):
    with pytest.raises(TypeError, match="spans_from_call"):
        chrome_trace([("job", 0, 0.0, 1.0)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="chrome_trace"):
        write_trace(tmp_path / "x.json", {"events": []})
    with pytest.raises(ValueError, match="pid must be"):
        chrome_trace([], pid=-1)
    assert LANES[0] == "compute"
