"""The schedule simulator against hand-computed timelines."""

from __future__ import annotations

import random

import pytest

from roundpipe_core.planning.plan import ModelExecutePlan
from roundpipe_core.planning.profile import LayerProfile
from roundpipe_core.planning.schedule import build_schedule
from roundpipe_core.planning.search import stage_times
from roundpipe_core.planning.simulate import simulate

pytestmark = pytest.mark.host_only

P = ModelExecutePlan


@pytest.mark.parametrize(
    ("s", "n", "m", "t"),
    [(4, 2, 2, 1.0), (8, 4, 5, 2.5), (6, 3, 3, 1.0), (8, 2, 7, 0.5), (3, 3, 4, 3.0)],
)
def test_equal_stages_closed_form(s, n, m, t):
    # A device runs one stage (all microbatches) at a time: (S/N) x M x t + (N-1) x t.
    plan = P.uniform(s, s, "infer")
    res = simulate(plan, [t] * s, [0.0] * s, n, m, run_type="infer")
    assert res.makespan_ms == pytest.approx((s / n) * m * t + (n - 1) * t)
    assert res.busy_ms == pytest.approx([(s / n) * m * t] * n)
    assert res.efficiency == pytest.approx(s * m / (s * m + n * (n - 1)))
    assert res.bubble_ratio == pytest.approx(1 - res.efficiency)


def test_fused_by_hand():
    # Jobs: F(layer 0) on dev0 at 1/mb, fused(layer 1) on dev1 at 1+2 = 3/mb,
    # B(layer 0) on dev0 at re 1 + bwd 2 = 3/mb.
    plan = P([range(0, 1)], [range(1, 2), range(0, 1)])
    res = simulate(plan, [1.0, 1.0], [2.0, 2.0], num_devices=2, num_microbatch=2)
    spans = [(e.kind, e.device, e.microbatch, e.start, e.end) for e in res.events]
    assert spans == [
        ("forward", 0, 0, 0.0, 1.0),
        ("forward", 0, 1, 1.0, 2.0),
        ("fused", 1, 0, 1.0, 4.0),
        ("fused", 1, 1, 4.0, 7.0),
        ("backward", 0, 0, 4.0, 7.0),
        ("backward", 0, 1, 7.0, 10.0),
    ]
    assert res.makespan_ms == 10.0
    assert res.busy_ms == [8.0, 6.0]
    assert res.efficiency == pytest.approx(14 / 20)


def test_train_backward_waits_for_whole_forward():
    # "train": forward() returns before loss.backward() starts the backward phase.
    plan = P([range(0, 1), range(1, 2)], [range(1, 2), range(0, 1)])
    res = simulate(plan, [1.0, 1.0], [1.0, 1.0], 2, 3, run_type="train")
    fwd_end = max(e.end for e in res.events if e.kind == "forward")
    assert fwd_end == 4.0  # F0 mb0..2 [0,3], F1 mb0..2 [1,4]
    assert min(e.start for e in res.events if e.kind == "backward") == fwd_end
    # B(layer 1) on dev0 [4,10]; B(layer 0) on dev1 waits mb by mb: ends at 10 + 2.
    assert res.makespan_ms == 12.0


def test_times_the_schedule_of_build_schedule():
    rng = random.Random(3)
    for _ in range(30):
        n_layers = rng.randint(2, 10)
        run_type = rng.choice(["infer", "train", "fused"])
        plan = P.uniform(n_layers, rng.randint(1, n_layers), run_type)
        devices, mbs = rng.randint(1, 4), rng.randint(1, 5)
        fwd = [rng.uniform(0.5, 2.0) for _ in range(n_layers)]
        bwd = [rng.uniform(0.5, 4.0) for _ in range(n_layers)]
        res = simulate(plan, fwd, bwd, devices, mbs, run_type=run_type)
        jobs = build_schedule(plan, run_type, devices, mbs)
        assert res.jobs == jobs
        by_job: dict[int, list] = {}
        for e in res.events:
            assert e.device == jobs[e.job].device
            by_job.setdefault(e.job, []).append(e)
        assert sorted(by_job) == [j.index for j in jobs]
        # Each device: its jobs in launch order, microbatches in order, no overlap.
        for d in range(devices):
            mine = [e for e in res.events if e.device == d]
            assert [(e.job, e.microbatch) for e in mine] == sorted(
                (e.job, e.microbatch) for e in mine
            )
            for a, b in zip(mine, mine[1:]):
                assert a.end <= b.start + 1e-9
        # Stage k of microbatch m after stage k-1 of microbatch m.
        chain = [j for j in jobs if j.kind == "forward"] + [j for j in jobs if j.kind != "forward"]
        end = {(e.job, e.microbatch): e.end for e in res.events}
        start = {(e.job, e.microbatch): e.start for e in res.events}
        for a, b in zip(chain, chain[1:]):
            for m in range(mbs):
                assert start[b.index, m] >= end[a.index, m] - 1e-9
        # Busy time = microbatches x the stage times of the plan.
        times = stage_times(plan, LayerProfile(fwd, bwd), run_type)
        assert sum(res.busy_ms) == pytest.approx(mbs * sum(times))


def test_explicit_owners_are_honoured():
    plan = P.from_layout(fwd="0:2,0:1", bwd="1:1,1:1,0:2", run_type="fused", num_devices=2)
    res = simulate(plan, [1.0] * 4, [2.0] * 4, 2, 3)
    owners = plan.fwd_owners + plan.bwd_owners
    for e in res.events:
        assert e.device == owners[e.job]
    # Both forward stages on device 0 serialise.
    f = [e for e in res.events if e.kind == "forward"]
    assert max(e.end for e in f) == pytest.approx(3 * 2.0 + 3 * 1.0)


def test_uploads_prefetch_behind_the_previous_job():
    plan = P.uniform(3, 3, "infer")
    # Cheap uploads are hidden after the first one.
    res = simulate(plan, [2.0] * 3, [0.0] * 3, 1, 1, run_type="infer", upload_ms=1.0)
    compute = [(e.start, e.end) for e in res.events if e.kind != "upload"]
    uploads = [(e.start, e.end) for e in res.events if e.kind == "upload"]
    assert uploads == [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]  # third waits for job 0 to free memory
    assert compute == [(1.0, 3.0), (3.0, 5.0), (5.0, 7.0)]
    # Slow uploads dominate: one in flight beside the running stage at most.
    res = simulate(plan, [2.0] * 3, [0.0] * 3, 1, 1, run_type="infer", upload_ms=[5.0, 5.0, 5.0])
    uploads = [(e.start, e.end) for e in res.events if e.kind == "upload"]
    compute = [(e.start, e.end) for e in res.events if e.kind != "upload"]
    assert uploads == [(0.0, 5.0), (5.0, 10.0), (10.0, 15.0)]
    assert compute == [(5.0, 7.0), (10.0, 12.0), (15.0, 17.0)]
    assert res.makespan_ms == 17.0
    assert res.busy_ms == [6.0]


def test_activation_handoff_latency():
    plan = P.uniform(2, 2, "infer")
    res = simulate(plan, [1.0, 1.0], [0.0, 0.0], 2, 1, run_type="infer", activation_ms=0.5)
    assert res.makespan_ms == 2.5
    same = simulate(plan, [1.0, 1.0], [0.0, 0.0], 1, 1, run_type="infer", activation_ms=0.5)
    assert same.makespan_ms == 2.0  # same device: nothing to hand over


def test_overlapping_iterations_removes_the_ramp():
    plan = P.uniform(8, 8, "fused")
    one = simulate(plan, [1.0] * 8, [2.0] * 8, 4, 5)
    seq = simulate(plan, [1.0] * 8, [2.0] * 8, 4, 5, iterations=4)
    assert seq.iteration_ms == pytest.approx(one.makespan_ms)
    ov = simulate(plan, [1.0] * 8, [2.0] * 8, 4, 5, iterations=4, overlap_iterations=True)
    assert ov.iteration_ms < one.makespan_ms
    assert ov.efficiency > one.efficiency + 0.03
    # Iteration 2 may not start before iteration 0 is done (one-step-stale weights).
    end0 = max(e.end for e in ov.events if e.iteration == 0)
    assert min(e.start for e in ov.events if e.iteration == 2) >= end0 - 1e-9


def test_bad_arguments():
    plan = P.uniform(2, 2, "fused")
    with pytest.raises(ValueError, match="bwd_ms has 1"):
        simulate(plan, [1.0, 1.0], [1.0], 2, 2)
    with pytest.raises(ValueError, match=r"upload_ms\[1\]"):
        simulate(plan, [1.0, 1.0], [1.0, 1.0], 2, 2, upload_ms=[1.0, -1.0])
    with pytest.raises(ValueError, match="iterations"):
        simulate(plan, [1.0, 1.0], [1.0, 1.0], 2, 2, iterations=0)
    with pytest.raises(ValueError, match="does not cover|outside"):
        simulate(plan, [1.0] * 3, [1.0] * 3, 2, 2)
    with pytest.raises(ValueError, match="num_microbatch"):
        simulate(plan, [1.0, 1.0], [1.0, 1.0], 2, 0)


def test_timeline_renders():
    plan = P.uniform(4, 4, "fused")
    text = simulate(plan, [1.0] * 4, [2.0] * 4, 2, 3).timeline(width=40)
    assert text.count("\n") == 1 and "X" in text and "B" in text and "F" in text


def test_chrome_trace():
    import json

    from roundpipe_core.running.trace import chrome_trace, spans_from_simulation

    plan = P.uniform(4, 2, "fused")
    res = simulate(plan, [1.0] * 4, [2.0] * 4, 2, 2, upload_ms=0.5)
    trace = json.loads(json.dumps(chrome_trace(spans_from_simulation(res, per_job=False))))
    rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(res.events)
    first = events[0]
    assert rows[first["tid"]] == "device 0 upload" and first["dur"] == 1000.0  # 2 layers x 0.5 ms
