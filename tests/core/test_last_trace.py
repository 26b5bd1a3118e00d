"""``RoundPipe.last_trace()``: the last call's measured timeline, blocking or not, as a
Chrome trace -- one row per device with the call's jobs, the optimizer steps on their
own row -- and ``spans_from_call``'s rule for which steps belong to a call."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from _util import mlp, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.running.timer import CallTiming, JobTiming
from roundpipe_core.running.trace import (
    job_name,
    spans_from_call,
    spans_from_roundpipe,
    write_trace,
)

PLAN = ModelExecutePlan([range(0, 3)], [range(3, 6), range(0, 3)])
DEVICES = 2


class _Sleep(nn.Module):
    """Long enough layers that spans stand well apart from clock noise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.001)
        return x


def _rp() -> RoundPipe:
    model = mlp()
    for i in range(len(model)):
        model[i] = nn.Sequential(model[i], _Sleep())
    cfg = RoundPipeRunConfig(num_microbatch=3)
    rp = RoundPipe(model, devices=f"cpu:{DEVICES}", model_run_config=cfg)
    rp.set_plan("fused", PLAN)  # the autograd path keeps its default plan
    return rp


def _x_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _rows(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


@pytest.mark.parametrize("blocking", [True, False])
def test_last_trace_has_the_last_calls_jobs_and_its_step(blocking, tmp_path):
    rp = _rp()
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    try:
        assert _x_events(rp.last_trace()) == []  # nothing ran yet
        for _ in range(2):
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            out = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=blocking)
            if not blocking:
                out.result(timeout=60)
            rp.step(lambda: (time.sleep(0.002), opt.step(), opt.zero_grad()), is_async=False)
        trace = rp.last_trace()
        schedule = list(rp.last_call.schedule)
    finally:
        rp.close()
    path = write_trace(tmp_path / "last.json", trace)
    assert json.loads(path.read_text()) == trace  # plain JSON, loadable by Perfetto
    rows = _rows(trace)
    assert sorted(rows.values()) == sorted(
        [
            f"device {d}{lane}"
            for d in range(DEVICES)
            for lane in ("", " upload", " activation", " gradient")
        ]
        + ["optimizer"]
    )
    events = _x_events(trace)
    compute = [e for e in events if rows[e["tid"]] in ("device 0", "device 1")]
    steps = [e for e in events if rows[e["tid"]] == "optimizer"]
    # the transfers each job waited on, on its device's rows: its parameters (once, even
    # when prefetched), each microbatch's input, and the gradients of fused/backward jobs
    by_lane: dict[str, list[str]] = {"upload": [], "activation": [], "gradient": []}
    for e in events:
        device, _, lane = rows[e["tid"]].partition(" ")[2].partition(" ")
        if lane:
            by_lane[lane].append(e["name"])
            assert e["name"].split(" ")[0][-1] == device  # the job ran on that device
    jobs = [job_name(j) for j in schedule]
    assert sorted(by_lane["upload"]) == sorted(f"{j} params" for j in jobs)
    assert sorted(by_lane["activation"]) == sorted(f"{j} in mb{m}" for j in jobs for m in range(3))
    assert sorted(by_lane["gradient"]) == sorted(f"{j} grads" for j in jobs if j[-2] != "F")
    # every job of the last call once, on the row of the device that ran it
    assert sorted(e["name"] for e in compute) == sorted(job_name(j) for j in schedule)
    for e in compute:
        assert rows[e["tid"]] == f"device {e['name'][-1]}"
        assert e["dur"] > 1000.0  # at least the sleeps of one stage, in microseconds
    # the step that followed the call, not the one of the call before
    assert len(steps) == 1 and steps[0]["name"] == "step"
    assert steps[0]["dur"] >= 2000.0
    assert steps[0]["ts"] >= max(e["ts"] + e["dur"] for e in compute) - 1.0
    assert min(e["ts"] for e in events) == 0.0


def test_last_trace_after_the_autograd_path_and_without_steps():
    """roundpipe(x) + backward(): one run spans both calls, so the trace shows the
    forward jobs and the backward jobs; without a step there is no optimizer row."""
    rp = _rp()
    try:
        x = torch.randn(6, 8, requires_grad=True)
        rp(x).pow(2).sum().backward()
        trace = rp.last_trace()
        schedule = list(rp.last_call.schedule)  # one record: the forward's and the backward's
    finally:
        rp.close()
    backward_jobs = [j for j in schedule if j.kind == "backward"]
    assert backward_jobs and len(backward_jobs) < len(schedule)
    rows = _rows(trace)
    assert "optimizer" not in rows.values()
    compute = [e for e in _x_events(trace) if rows[e["tid"]] in ("device 0", "device 1")]
    names = [e["name"] for e in compute]
    assert sorted(names) == sorted(job_name(j) for j in schedule)
    backward = [n for n in names if "B" in n]
    assert sorted(backward) == sorted(job_name(j) for j in backward_jobs)
    assert any("F" in n for n in names)
    assert {e["args"]["kind"] for e in compute} == {"forward", "backward"}
    # both phases' transfers: the backward jobs' gradients among them
    grads = [e["name"] for e in _x_events(trace) if rows[e["tid"]].endswith(" gradient")]
    assert sorted(grads) == sorted(f"{job_name(j)} grads" for j in backward_jobs)


def _job(stage: int, device: int):
    from roundpipe_core.planning.schedule import build_schedule

    return next(
        j
        for j in build_schedule(PLAN, "fused", DEVICES, 3)
        if (j.stage, j.device) == (stage, device)
    )


def test_a_calls_spans_keep_the_steps_that_end_after_it_starts():
    timing = CallTiming()
    timing.jobs.append(JobTiming(_job(0, 0), 0, 10.0, 11.0, 0.9))
    old = (8.0, 9.5)  # the step before the call
    overlapping = (9.5, 10.5)  # an asynchronous one
    after = (11.0, 11.2)
    spans = spans_from_call(timing, [old, overlapping, after])
    assert [s.lane for s in spans] == ["compute", "optimizer", "optimizer"]
    assert [(s.start_s, s.end_s) for s in spans] == [(10.0, 11.0), overlapping, after]
    assert spans[0].name == job_name(_job(0, 0)) and spans[0].device == 0
    # no call yet: every recorded step is shown
    assert [(s.start_s, s.end_s) for s in spans_from_call(CallTiming(), [old])] == [old]


def test_the_engine_times_every_step_even_a_failing_one_and_keeps_the_latest():
    rp = _rp()
    try:
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
        for _ in range(10):
            rp.step(lambda: (opt.step(), time.sleep(0.001)), is_async=False)
        steps = [s for s in spans_from_roundpipe(rp) if s.lane == "optimizer"]
        assert len(steps) == 8  # a long run keeps a few, enough to cover the last call
        assert all(s.duration_s >= 0.001 for s in steps)

        def boom() -> None:
            time.sleep(0.001)
            raise RuntimeError("step failed")

        with pytest.raises(RuntimeError, match="step failed"):
            rp.step(boom, is_async=False)
        last = [s for s in spans_from_roundpipe(rp) if s.lane == "optimizer"][-1]
        assert last.end_s > steps[-1].end_s and last.duration_s >= 0.001
    finally:
        rp.close()


@pytest.mark.usefixtures("concurrent_planning")  # multi-stage plans on CPU workers
def test_core_example_writes_the_last_trace(tmp_path, monkeypatch, capsys):
    examples = Path(__file__).parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    import core_train

    path = tmp_path / "last.json"
    core_train.main(["--devices", "cpu:2", "--steps", "3", "--trace", str(path)])
    assert "trace of the last iteration" in capsys.readouterr().out
    trace = json.loads(path.read_text())
    rows = set(_rows(trace).values())
    lanes = ("", " upload", " activation", " gradient")
    assert rows == {f"device {d}{lane}" for d in range(2) for lane in lanes} | {"optimizer"}
    assert len([e for e in _x_events(trace) if e["cat"] == "optimizer"]) >= 1
