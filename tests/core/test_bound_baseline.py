"""The weight-bound baseline of ``benchmarks/planner.py`` (``benchmarks/bound_baseline.py``)
against hand-computed timelines, and the benchmark itself runs one case end to end."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roundpipe_core.planning.plan import ModelExecutePlan
from roundpipe_core.planning.simulate import simulate
from roundpipe_core.running.trace import spans_from_simulation

pytestmark = pytest.mark.host_only

ROOT = Path(__file__).resolve().parents[2]
# benchmarks/ is no package: load the module from its file
_spec = importlib.util.spec_from_file_location(
    "bound_baseline", ROOT / "benchmarks" / "bound_baseline.py"
)
assert _spec is not None and _spec.loader is not None
bb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bb)

P = ModelExecutePlan


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_bound_baseline_closed_form(schedule):
    # N equal stages bound to N devices: (M + N - 1) x (F + B) for GPipe and 1F1B alike.
    n, m = 4, 6
    stages = [range(i, i + 1) for i in range(n)]
    res = bb.simulate_bound_stages(
        stages, [1.0] * n, [2.0] * n, n, m, re_ms=[0.0] * n, fused_last=False, schedule=schedule
    )
    assert res.makespan_ms == pytest.approx((m + n - 1) * 3.0)
    assert res.busy_ms == pytest.approx([m * 3.0] * n)


def test_bound_1f1b_order_and_recompute():
    stages = [range(0, 1), range(1, 2)]
    res = bb.simulate_bound_stages(stages, [1.0, 1.0], [2.0, 2.0], 2, 2)
    order = [(e.device, e.kind[0], e.microbatch) for e in res.events if e.device == 1]
    assert order == [(1, "f", 0), (1, "b", 0), (1, "f", 1), (1, "b", 1)]
    # Stage 0 recomputes (1 + 2), the last stage does not (2).
    assert res.busy_ms == [2 * (1 + 3), 2 * (1 + 2)]


def test_bound_plan_uses_backward_stages():
    plan = P.uniform(6, 3, "fused")
    rr = simulate(plan, [1.0] * 6, [2.0] * 6, 3, 4)
    bound = bb.simulate_bound(plan, [1.0] * 6, [2.0] * 6, 3, 4)
    assert rr.makespan_ms < bound.makespan_ms
    many = P.uniform(6, 6, "fused")
    with pytest.raises(ValueError, match="1F1B binds one stage per device"):
        bb.simulate_bound(many, [1.0] * 6, [2.0] * 6, 3, 4)
    g = bb.simulate_bound(many, [1.0] * 6, [2.0] * 6, 3, 4, schedule="gpipe")
    assert {e.device for e in g.events} == {0, 1, 2}
    with pytest.raises(ValueError, match="schedule must be one of"):
        bb.simulate_bound(plan, [1.0] * 6, [2.0] * 6, 3, 4, schedule="fifo")


def test_balanced_stages():
    assert bb.balanced_stages([1, 1, 1, 1, 4], 2) == [range(0, 4), range(4, 5)]
    assert bb.balanced_stages([5, 1, 1, 1], 3) == [range(0, 1), range(1, 4)]  # 5 is the floor
    assert len(bb.balanced_stages([1.0] * 10, 4)) == 4
    with pytest.raises(ValueError, match="num_stages"):
        bb.balanced_stages([1.0], 0)


def test_jobless_events_make_per_microbatch_spans():
    # the baseline's events name no job of a schedule: the trace shows each microbatch
    plan = P([range(0, 3), range(3, 4)], [range(4, 6), range(2, 4), range(1, 2), range(0, 1)])
    bound = spans_from_simulation(bb.simulate_bound(plan, [1.0] * 6, [2.0] * 6, 4, 2))
    assert len(bound) == 2 * 4 * 2 and all(s.lane == "compute" for s in bound)


def test_planner_benchmark_runs_one_case():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "planner.py", "--timeline", "qwen3-1.7b", "2", "3"],
        cwd=ROOT / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "dev1 |" in out.stdout
