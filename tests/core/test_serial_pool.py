"""CPU workers compute one at a time: the simulator, the planner and the default plan
know it (fewest stages memory allows, the same plan every time); GPU pools keep
their concurrent plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe
from roundpipe_core.plan_choice import PlanChoice
from roundpipe_core.planning.planner import predicted_speedup
from roundpipe_core.planning.profile import LayerProfile
from roundpipe_core.planning.schedule import build_schedule
from roundpipe_core.running.devices.pool import DevicePool
from roundpipe_core.simulate import simulate, simulated_iteration_ms
from tests.core._util import sum_sq

MB = 1 << 20


def _profile(fwd: list[float], mem: float = MB) -> LayerProfile:
    n = len(fwd)
    return LayerProfile(
        fwd_ms=fwd, bwd_ms=[2 * f for f in fwd], param_bytes=[int(mem)] * n, act_bytes=[0.0] * n
    )


def test_cpu_workers_do_not_compute_concurrently() -> None:
    pool = DevicePool("cpu:2")
    try:
        assert pool.concurrent is False
    finally:
        pool.close()


def test_serial_simulation_adds_up_every_job() -> None:
    plan = ModelExecutePlan.from_layout(fwd="2,2", bwd="2,1,1,1,1", run_type="fused")
    fwd, bwd = [1.0] * 6, [2.0] * 6
    m = 3
    jobs = build_schedule(plan, "fused", 2, m)
    work = 0.0
    for job in jobs:
        layers = list(job.layers)
        if job.kind == "forward":
            work += sum(fwd[i] for i in layers) * m
        elif job.kind == "fused":
            work += sum(fwd[i] + bwd[i] for i in layers) * m
        else:  # recompute + backward
            work += sum(fwd[i] + bwd[i] for i in layers) * m
    serial = simulate(plan, fwd, bwd, 2, m, concurrent=False).makespan_ms
    assert serial == pytest.approx(work)
    # the planner's estimate (no timeline) agrees
    estimate = simulated_iteration_ms(plan, LayerProfile(fwd, bwd), "fused", 2, m, concurrent=False)
    assert estimate == pytest.approx(work)
    # two concurrent devices overlap: strictly faster than the sum
    assert simulate(plan, fwd, bwd, 2, m).makespan_ms < work


@pytest.mark.parametrize("run_type", ["fused", "train", "infer"])
def test_serial_plans_have_the_fewest_stages_whatever_the_timings(run_type: str) -> None:
    even = _profile([1.0] * 8)
    skewed = _profile([1.0, 5.0, 1.0, 1.0, 9.0, 1.0, 1.0, 2.0])
    plans = [
        ModelExecutePlan.auto(run_type, p, min_stages=2, concurrent=False) for p in (even, skewed)
    ]
    assert plans[0] == plans[1]
    plan = plans[0]
    assert len(plan.fwd_plan) == (0 if run_type == "fused" else 1)
    assert len(plan.bwd_plan) == (0 if run_type == "infer" else 1)
    # with devices that do overlap, the planner still pipelines
    concurrent = ModelExecutePlan.auto(run_type, even, min_stages=2, concurrent=True)
    assert len(concurrent.fwd_plan) + len(concurrent.bwd_plan) > 1


def test_serial_plans_split_only_where_memory_forces_it() -> None:
    prof = _profile([1.0] * 8, mem=100 * MB)
    # a backward stage holds parameters + gradients: 200 MB per layer; a cap of
    # model_memory_limit / 2 = 450 MiB fits two layers, not three
    plan = ModelExecutePlan.auto(
        "fused", prof, min_stages=2, model_memory_limit=0.9 * 1000 / 1024, concurrent=False
    )
    assert all(len(s) <= 2 for s in plan.bwd_plan)
    assert len(plan.bwd_plan) == 4  # as few as memory allows: 8 layers, two per stage


def test_default_plan_on_cpu_workers_is_one_stage_and_stays() -> None:
    torch.manual_seed(0)
    rp = RoundPipe(nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]), devices="cpu:2")
    try:
        first = rp.plan_for("fused")
        assert first == ModelExecutePlan([], [range(0, 6)])
        x, y = torch.randn(6, 16), torch.randn(6, 16)
        for _ in range(PlanChoice.DEFAULT_REPLAN_AFTER + 2):  # past the settled re-plan
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
            assert rp.plan_for("fused") == first
        # a multi-stage plan on CPU workers is predicted slower (more recompute, no overlap)
        piped = ModelExecutePlan.from_layout(fwd="2,3", bwd="1,1,1,1,1,1", run_type="fused")
        assert predicted_speedup(piped, first, rp, "fused", 2, 3, concurrent=False) > 1.0
    finally:
        rp.close()


def test_concurrent_must_be_a_bool() -> None:
    prof = _profile([1.0] * 4)
    with pytest.raises(TypeError, match="concurrent must be True, False or None"):
        ModelExecutePlan.auto("fused", prof, min_stages=2, concurrent="no")  # type: ignore[arg-type]
    plan = ModelExecutePlan.uniform(4, 2, "fused")
    with pytest.raises(TypeError, match="concurrent must be True or False"):
        simulate(plan, [1.0] * 4, [1.0] * 4, 2, 2, concurrent=1)  # type: ignore[arg-type]
