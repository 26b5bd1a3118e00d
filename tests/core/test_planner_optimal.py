"""The exact planner against brute force and against the published greedy search.

Random profiles come from a seeded generator (property-style: many small random
cases, reproducible); brute force enumerates every valid plan of a few layers.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe_core.planning.plan import ModelExecutePlan
from roundpipe_core.planning.profile import LayerProfile
from roundpipe_core.planning.search import (
    pipeline_estimate,
    plan_cost,
    plan_objective,
    search_plans,
)

pytestmark = pytest.mark.host_only


def compositions(n: int):
    """Every way to cut layers 0..n-1 into contiguous stages, as lists of ranges."""
    if n == 0:
        yield []
        return
    for cuts in itertools.product((False, True), repeat=n - 1):
        stages, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                stages.append(range(start, i))
                start = i
        stages.append(range(start, n))
        yield stages


def all_plans(n: int, run_type: str):
    if run_type == "infer":
        for f in compositions(n):
            yield ModelExecutePlan(f, [])
    elif run_type == "train":
        for f in compositions(n):
            for b in compositions(n):
                yield ModelExecutePlan(f, list(reversed(b)))
    else:
        for start in range(n):
            for f in compositions(start):
                for b in compositions(start):
                    yield ModelExecutePlan(f, [range(start, n)] + list(reversed(b)))


def memory_ok(plan: ModelExecutePlan, prof: LayerProfile, run_type: str, cap: float) -> bool:
    fmem, bmem = prof.stage_mem()
    stages = [(r, fmem) for r in plan.fwd_plan]
    if run_type != "infer":
        stages += [(r, bmem) for r in plan.bwd_plan]
    return all(sum(mem[i] for i in r) <= cap for r, mem in stages)


def random_profile(rng: random.Random, n: int, with_memory: bool) -> LayerProfile:
    # Integer-ish times make ties (and so tie-breaking bugs) likely.
    fwd = [float(rng.choice([1, 1, 2, 3, 5, 8])) for _ in range(n)]
    bwd = [f * rng.choice([1.5, 2.0, 2.5]) for f in fwd]
    re = [f * rng.choice([1.0, 1.0, 1.2]) for f in fwd]
    mem = [rng.randint(1, 6) for _ in range(n)] if with_memory else None
    return LayerProfile(fwd, bwd, re_ms=re, param_bytes=mem)


def brute_force(prof, run_type, objective, min_stages, cap, devices, microbatches):
    best = None
    for plan in all_plans(prof.num_layers, run_type):
        if not memory_ok(plan, prof, run_type, cap):
            continue
        value = plan_objective(
            [plan], [prof], run_type, objective, min_stages, devices, microbatches
        )
        if best is None or value < best:
            best = value
    return best


@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
@pytest.mark.parametrize("objective", ["stages", "pipeline"])
def test_exact_matches_brute_force(run_type, objective):
    rng = random.Random(f"{run_type}-{objective}")
    for _ in range(60):
        n = rng.randint(1, 6 if run_type != "train" else 5)
        with_memory = rng.random() < 0.5
        prof = random_profile(rng, n, with_memory)
        fmem, bmem = prof.stage_mem()
        biggest = max(fmem if run_type == "infer" else bmem)
        cap = float(rng.randint(biggest, biggest * 3)) if with_memory else float("inf")
        m = rng.randint(1, 5)
        devices, mbs = rng.randint(1, 4), rng.randint(1, 6)
        res = search_plans(
            run_type, [prof], m, cap, objective=objective, num_devices=devices, num_microbatch=mbs
        )
        plan = res.plans[0]
        plan.check_valid(n, run_type)
        assert memory_ok(plan, prof, run_type, cap)
        _, stages, slowest = plan_cost(plan, prof, run_type, m)
        assert slowest <= res.stage_ms * (1 + 1e-9)
        assert stages == res.num_stages
        expect = brute_force(prof, run_type, objective, m, cap, devices, mbs)
        assert res.cost == pytest.approx(expect, rel=1e-9), (prof, m, devices, mbs)


@st.composite
def _planning_case(draw):
    run_type = draw(st.sampled_from(["infer", "train", "fused"]))
    n = draw(st.integers(1, 5 if run_type == "train" else 6))
    fwd = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0, 5.0, 8.0]), min_size=n, max_size=n))
    ratio = draw(st.sampled_from([1.5, 2.0, 2.5]))
    mem = draw(st.one_of(st.none(), st.lists(st.integers(1, 6), min_size=n, max_size=n)))
    prof = LayerProfile(fwd, [f * ratio for f in fwd], param_bytes=mem)
    fmem, bmem = prof.stage_mem()
    biggest = max(fmem if run_type == "infer" else bmem)
    cap = float(draw(st.integers(biggest, biggest * 3))) if mem is not None else float("inf")
    return (
        run_type,
        prof,
        cap,
        draw(st.integers(1, 5)),
        draw(st.integers(1, 4)),
        draw(st.integers(1, 6)),
        draw(st.sampled_from(["stages", "pipeline"])),
    )


@settings(max_examples=60, deadline=None)
@given(_planning_case())
def test_exact_is_optimal_against_brute_force_hypothesis(case):
    """Property test (hypothesis): on any small profile the exact search finds the
    minimum of its objective over every valid plan under the memory cap."""
    run_type, prof, cap, m, devices, mbs, objective = case
    res = search_plans(
        run_type, [prof], m, cap, objective=objective, num_devices=devices, num_microbatch=mbs
    )
    assert memory_ok(res.plans[0], prof, run_type, cap)
    res.plans[0].check_valid(prof.num_layers, run_type)
    expect = brute_force(prof, run_type, objective, m, cap, devices, mbs)
    assert res.cost == pytest.approx(expect, rel=1e-9)


@pytest.mark.parametrize("objective", ["stages", "pipeline"])
def test_exact_joint_planning_matches_brute_force(objective):
    rng = random.Random(7)
    for _ in range(25):
        profs = [random_profile(rng, rng.randint(1, 4), False) for _ in range(2)]
        m, devices, mbs = rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 6)
        kw = dict(objective=objective, num_devices=devices, num_microbatch=mbs)
        res = search_plans("fused", profs, m, **kw)
        best = None
        for p0 in all_plans(profs[0].num_layers, "fused"):
            for p1 in all_plans(profs[1].num_layers, "fused"):
                value = plan_objective([p0, p1], profs, "fused", min_stages=m, **kw)
                best = value if best is None else min(best, value)
        assert res.cost == pytest.approx(best, rel=1e-9)
        assert plan_objective(res.plans, profs, "fused", min_stages=m, **kw) == pytest.approx(best)
        assert len(res.plans) == 2


@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
def test_exact_never_worse_than_greedy(run_type):
    rng = random.Random(run_type)
    for _ in range(150):
        n = rng.randint(1, 40)
        prof = LayerProfile(
            [rng.uniform(0.1, 5.0) for _ in range(n)],
            [rng.uniform(0.2, 10.0) for _ in range(n)],
            param_bytes=[rng.randint(1, 100) for _ in range(n)],
        )
        cap = float(rng.randint(200, 2000))
        m = rng.randint(1, 16)
        exact = search_plans(run_type, [prof], m, cap)
        greedy = search_plans(run_type, [prof], m, cap, method="greedy")
        assert exact.cost <= greedy.cost * (1 + 1e-9)
        for res in (exact, greedy):
            value, _, _ = plan_cost(res.plans[0], prof, run_type, m)
            assert value <= res.cost * (1 + 1e-9)


def test_exact_strictly_better_than_greedy():
    # One slow layer and two medium ones: the greedy window (<= 1.1 x the slowest
    # layer) forces three stages (cost 3 x 10 = 30); two stages of <= 12 cost 24.
    prof = LayerProfile([10.0, 6.0, 6.0], [0.0, 0.0, 0.0])
    exact = search_plans("infer", [prof], 2)
    greedy = search_plans("infer", [prof], 2, method="greedy")
    assert greedy.cost == pytest.approx(30.0)
    assert exact.cost == pytest.approx(24.0)
    assert exact.plans[0].fwd_plan == [range(0, 1), range(1, 3)]
    # A transformer-shaped profile (LM head 5x a layer) on 2 devices.
    fwd = [0.05] + [1.0] * 28 + [5.0]
    qwen = LayerProfile(fwd, [2 * f for f in fwd])
    e = search_plans("fused", [qwen], 2)
    g = search_plans("fused", [qwen], 2, method="greedy")
    assert e.cost < g.cost * 0.99


def test_pipeline_estimate_is_exact_for_equal_stages():
    from roundpipe_core.planning.simulate import simulate

    for s, n, m in itertools.product(range(1, 13), range(1, 6), range(1, 9)):
        plan = ModelExecutePlan.uniform(s, s, "infer")
        sim = simulate(plan, [1.0] * s, [1.0] * s, n, m, run_type="infer")
        assert sim.makespan_ms == pytest.approx(pipeline_estimate(s, 1.0, n, m, float(s)))


def test_refine_never_slower_than_greedy_in_simulation():
    from roundpipe_core.planning.simulate import simulate

    rng = random.Random(11)
    for _ in range(20):
        n = rng.randint(4, 30)
        fwd = [rng.uniform(0.5, 2.0) for _ in range(n)]
        fwd[-1] *= rng.choice([1, 3, 5])
        prof = LayerProfile(fwd, [2 * f for f in fwd])
        devices = rng.choice([2, 4, 8])
        mbs = devices + rng.choice([1, devices])
        kw = dict(num_devices=devices, num_microbatch=mbs)
        best = search_plans("fused", [prof], devices, objective="pipeline", refine=True, **kw)
        greedy = search_plans("fused", [prof], devices, method="greedy")

        ours = simulate(best.plans[0], fwd, prof.bwd_ms, devices, mbs).makespan_ms
        theirs = simulate(greedy.plans[0], fwd, prof.bwd_ms, devices, mbs).makespan_ms
        assert ours <= theirs * (1 + 1e-9)


def test_greedy_refined_walks_from_its_pick():
    """``method="greedy"`` with ``refine`` has no shortlist of caps: the walk starts from
    the greedy pick alone and never makes it slower in simulation."""
    from roundpipe_core.planning.simulate import simulate

    fwd = [0.5, 1.0, 1.5, 1.0, 2.0, 5.0]
    prof = LayerProfile(fwd, [2 * f for f in fwd])
    kw = dict(num_devices=2, num_microbatch=3)
    walked = search_plans(
        "fused", [prof], 2, method="greedy", objective="pipeline", refine=True, **kw
    )
    greedy = search_plans("fused", [prof], 2, method="greedy")
    ours = simulate(walked.plans[0], fwd, prof.bwd_ms, 2, 3).makespan_ms
    theirs = simulate(greedy.plans[0], fwd, prof.bwd_ms, 2, 3).makespan_ms
    assert ours <= theirs * (1 + 1e-9)


def test_search_rejects_bad_arguments():
    prof = LayerProfile([1.0, 2.0], [1.0, 2.0], param_bytes=[10, 10])
    with pytest.raises(ValueError, match="method"):
        search_plans("fused", [prof], method="dp")
    with pytest.raises(ValueError, match="objective"):
        search_plans("fused", [prof], objective="speed")
    with pytest.raises(ValueError, match="needs num_devices"):
        search_plans("fused", [prof], objective="pipeline")
    with pytest.raises(ValueError, match="memory cap"):
        search_plans("fused", [prof], 1, memory_cap_bytes=15)
    with pytest.raises(ValueError, match="at least one model"):
        search_plans("fused", [])
    with pytest.raises(ValueError, match="fwd_ms has 2"):
        LayerProfile([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"bwd_ms\[1\]"):
        LayerProfile([1.0, 2.0], [1.0, float("nan")])


def test_walk_never_slower_and_sometimes_faster_in_simulation():
    """The simulator-guided walk starts from the cap search's pick and only moves to
    faster plans; on uneven profiles it finds some."""
    from roundpipe_core.planning.simulate import simulated_iteration_ms

    rnd = random.Random(7)
    improved = 0
    for _ in range(30):
        n = rnd.randint(4, 12)
        fwd = [rnd.uniform(0.2, 3.0) for _ in range(n)]
        bwd = [x * rnd.uniform(1.5, 2.5) for x in fwd]
        prof = LayerProfile(fwd, bwd)
        devices = rnd.randint(2, 4)
        mbs = rnd.randint(devices, 2 * devices + 1)
        times = []
        for walk in (False, True):
            found = search_plans(
                "fused",
                [prof],
                devices,
                objective="pipeline",
                num_devices=devices,
                num_microbatch=mbs,
                refine=True,
                walk=walk,
            )
            found.plans[0].check_valid(n, "fused")
            times.append(simulated_iteration_ms(found.plans[0], prof, "fused", devices, mbs))
        assert times[1] <= times[0] * (1 + 1e-9)
        improved += times[1] < times[0] * (1 - 1e-6)
    assert improved >= 3


def test_overlap_aware_plan_is_faster_in_the_overlapped_steady_state():
    """With overlap_iterations the planner ranks plans by what blocking=False runs: the
    steady state of overlapped iterations, where another plan can win."""
    from roundpipe_core.planning.planner import auto
    from roundpipe_core.planning.simulate import simulate

    # Qwen-shaped: a cheap embedding, 20 equal layers, an LM head of five layers' cost.
    fwd = [0.02] + [1.0] * 20 + [5.0]
    bwd = [0.1] + [2.0] * 20 + [10.0]
    prof = LayerProfile(fwd, bwd)
    devices, mbs = 4, 5
    one = auto("fused", prof, min_stages=devices, num_microbatch=mbs)
    steady = auto("fused", prof, min_stages=devices, num_microbatch=mbs, overlap_iterations=True)
    steady.check_valid(len(fwd), "fused")

    def per_iteration(plan, iterations):
        return simulate(
            plan, fwd, bwd, devices, mbs, iterations=iterations, overlap_iterations=True
        ).iteration_ms

    assert per_iteration(steady, 32) < 0.95 * per_iteration(one, 32)
    assert per_iteration(one, 1) <= per_iteration(steady, 1) * (1 + 1e-9)


def test_predicted_speedup_ranks_plans_by_simulation():
    from roundpipe_core.planning.planner import predicted_speedup
    from roundpipe_core.planning.simulate import simulated_iteration_ms

    fwd = [1.0] * 8
    prof = LayerProfile(fwd, [2.0] * 8)
    good = ModelExecutePlan.from_layout(fwd="2,2,2", bwd="2,2,2,2", run_type="fused")
    poor = ModelExecutePlan.from_layout(fwd="6", bwd="2,6", run_type="fused")
    gain = predicted_speedup(poor, good, prof, "fused", 2, 3)
    t_poor = simulated_iteration_ms(poor, prof, "fused", 2, 3, False)
    t_good = simulated_iteration_ms(good, prof, "fused", 2, 3, False)
    assert gain == pytest.approx(t_poor / t_good) and gain > 1.0
    assert predicted_speedup(good, good, prof, "fused", 2, 3) == 1.0
    with pytest.raises(ValueError, match="bwd_plan"):
        predicted_speedup(good, ModelExecutePlan([range(0, 8)], []), prof, "fused", 2, 3)
