"""ModelExecutePlan.auto(): valid plans, memory cap, defaults, joint planning, real timings."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.planning.profile import LayerProfile
from roundpipe_core.planning.schedule import build_schedule
from roundpipe_core.planning.search import plan_cost
from roundpipe_core.running.timer import ModelTimer
from tests.core._util import assert_grads_match, reference_grads, sum_sq

GB = 1024**3


def fake_model(fwd, bwd=None, param_bytes=None, devices=4, capacity_gb=8.0):
    """What auto() reads from a RoundPipe: the timer, the device count and the pool."""
    n = len(fwd)
    timer = SimpleNamespace(
        fwd_ms=list(fwd),
        re_ms=list(fwd),
        bwd_ms=list(bwd) if bwd is not None else [2 * f for f in fwd],
        layer_param_bytes=list(param_bytes) if param_bytes is not None else [1000] * n,
        layer_grad_bytes=list(param_bytes) if param_bytes is not None else [1000] * n,
    )
    worker = SimpleNamespace(memory_capacity=lambda: int(capacity_gb * GB))
    return SimpleNamespace(
        model_timer=timer,
        num_layers=n,
        num_devices=devices,
        pool=SimpleNamespace(workers=[worker] * devices),
    )


def stage_bytes(plan, model, run_type):
    t = model.model_timer
    out = [sum(t.layer_param_bytes[i] for i in r) for r in plan.fwd_plan]
    if run_type != "infer":
        out += [
            sum(t.layer_param_bytes[i] + t.layer_grad_bytes[i] for i in r) for r in plan.bwd_plan
        ]
    return out


@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
@pytest.mark.parametrize("objective", ["pipeline", "stages"])
def test_auto_plans_are_valid_and_respect_memory(run_type, objective):
    gen = torch.Generator().manual_seed(1)
    for trial in range(10):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        fwd = (torch.rand(n, generator=gen) * 3 + 0.1).tolist()
        sizes = (torch.randint(1, 200, (n,), generator=gen) * 2**20).tolist()
        model = fake_model(fwd, param_bytes=sizes, devices=1 + trial % 4)
        limit = 2 * max(sizes) * 2 / GB * 1.5  # room for a bit more than the biggest layer
        plan = ModelExecutePlan.auto(run_type, model, model_memory_limit=limit, objective=objective)
        plan.check_valid(n, run_type, model.num_devices)
        assert max(stage_bytes(plan, model, run_type)) <= limit * GB / 2
        build_schedule(plan, run_type, model.num_devices, model.num_devices + 1)


def test_default_memory_limit_is_60_percent_of_smallest_device():
    # 10 layers of 0.5 GB (1 GB with gradients) on one device. Without a memory
    # bound one fused stage (no recompute at all) is fastest; devices of 10 GB give
    # a limit of 6 GB, so 3 GB per stage: the fused stage holds 3 layers.
    model = fake_model([1.0] * 10, param_bytes=[GB // 2] * 10, devices=1)
    small = SimpleNamespace(memory_capacity=lambda: 10 * GB)
    big = SimpleNamespace(memory_capacity=lambda: 80 * GB)
    model.pool.workers = [big, small]
    plan = ModelExecutePlan.auto("fused", model)
    assert max(stage_bytes(plan, model, "fused")) <= 3 * GB
    assert len(plan.bwd_plan[0]) == 3
    model.pool.workers = [big]
    plan = ModelExecutePlan.auto("fused", model)
    assert plan.bwd_plan == [range(0, 10)] and plan.fwd_plan == []
    plan = ModelExecutePlan.auto("fused", model, model_memory_limit=4.0)
    assert len(plan.bwd_plan[0]) == 2


def test_oversized_layer_raises_the_limit_with_a_warning():
    model = fake_model([1.0, 1.0, 1.0], param_bytes=[GB, 4 * GB, GB], devices=2)
    with pytest.warns(RuntimeWarning, match="layer 1 of model 0 needs 8.000 GB"):
        plan = ModelExecutePlan.auto("fused", model, model_memory_limit=4.0)
    plan.check_valid(3, "fused")
    assert range(1, 2) in plan.bwd_plan  # nothing fits beside it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelExecutePlan.auto("fused", model, model_memory_limit=16.0)


def test_min_stages_default_and_effect():
    # Published cost max(S, min_stages) x T: [3,1][1,1,1,1] (2 x 4 = 8) is as cheap as
    # it gets (the work is 8); with min_stages = 3 that plan costs 3 x 4 and
    # [3][1,1][1,1,1] (3 x 3 = 9) wins.
    model = fake_model([3.0, 1.0, 1.0, 1.0, 1.0, 1.0], devices=3)
    few = ModelExecutePlan.auto("infer", model, objective="stages", min_stages=1)
    assert few.fwd_plan == [range(0, 2), range(2, 6)]
    default = ModelExecutePlan.auto("infer", model, objective="stages")
    assert default.fwd_plan == [range(0, 1), range(1, 3), range(3, 6)]


def test_joint_planning_shares_one_stage_cap():
    enc = fake_model([1.0] * 6, devices=2)
    dec = fake_model([3.0] * 4, devices=2)
    plans = ModelExecutePlan.auto("fused", enc, dec)
    assert isinstance(plans, list) and len(plans) == 2
    plans[0].check_valid(6, "fused")
    plans[1].check_valid(4, "fused")
    slow = [
        plan_cost(p, LayerProfile.from_timer(m.model_timer), "fused")[2]
        for p, m in zip(plans, (enc, dec))
    ]
    # One shared cap: the encoder's stages are not cut finer than the decoder's pace needs.
    assert slow[0] <= slow[1] * 1.0001 or slow[1] <= slow[0] * 1.0001
    single = ModelExecutePlan.auto("fused", enc)
    assert isinstance(single, ModelExecutePlan)


def test_auto_accepts_timers_and_profiles():
    timer = ModelTimer([nn.Linear(4, 4) for _ in range(5)])
    plan = ModelExecutePlan.auto("train", timer, min_stages=2)
    plan.check_valid(5, "train")
    prof = LayerProfile([1.0] * 5, [2.0] * 5)
    assert ModelExecutePlan.auto("infer", prof, min_stages=2).fwd_plan


def test_auto_bad_arguments():
    model = fake_model([1.0] * 4)
    with pytest.raises(ValueError, match="at least one model"):
        ModelExecutePlan.auto("fused")
    with pytest.raises(ValueError, match="run_type"):
        ModelExecutePlan.auto("forward", model)
    with pytest.raises(TypeError, match="not a RoundPipe model"):
        ModelExecutePlan.auto("fused", object())
    with pytest.raises(ValueError, match="min_stages"):
        ModelExecutePlan.auto("fused", model, min_stages=0)
    with pytest.raises(ValueError, match="model_memory_limit"):
        ModelExecutePlan.auto("fused", model, model_memory_limit=-1)
    with pytest.raises(ValueError, match="min_stages is needed"):
        ModelExecutePlan.auto("fused", LayerProfile([1.0], [1.0]))


class _Slow(nn.Module):
    """A layer with a fixed extra cost on whatever device runs it: a cost that timing
    noise (a loaded CPU, kernel-launch overhead dwarfing small kernels on a GPU) cannot hide."""

    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner = inner
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda._sleep(int(self.seconds * 2e9))  # GPU clock cycles, ~2 GHz
        else:
            time.sleep(self.seconds)
        return self.inner(x)


# On CPU workers under fake CUDA too: there a round of this test took 13-23 s (the fake
# checks every copy's source bytes), the planner may need a second round of timings, and
# CI's fake-CUDA stage timed out at 120 s. In that mode the rest of the suite still
# measures through CUDA workers' events (test_default_plan.py re-plans from them); what
# this test is about -- measured timings move auto()'s plan -- is the same on either
# backend.
@pytest.mark.cpu_backend
@pytest.mark.usefixtures("concurrent_planning")  # multi-stage plans on CPU workers
def test_heavy_layer_isolated_after_warm_up():
    """A real run: layer 3 costs far more than the others; measured timings make auto() give it its own stage."""
    torch.manual_seed(0)
    width = 160

    def block(hidden: int) -> nn.Module:
        return nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width))

    layers = [block(width) for _ in range(8)]
    layers[3] = _Slow(block(width), 0.006)
    rp = RoundPipe(nn.Sequential(*layers), devices="cpu:4")
    try:
        x, y = torch.randn(1000, width), torch.randn(1000, width)
        ok = False
        for _ in range(8):  # warm-up iterations; timing noise on a loaded machine may need more
            for _ in range(3):
                rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
            timer = rp.model_timer
            # the sleep is in the layer's forward: it shows in its forward (and recompute) times
            others = sorted(timer.fwd_ms[:3] + timer.fwd_ms[4:])
            heavy_measured = timer.fwd_ms[3] > 1.5 * others[len(others) // 2]
            fused = ModelExecutePlan.auto("fused", rp)
            train = ModelExecutePlan.auto("train", rp)
            infer = ModelExecutePlan.auto("infer", rp)
            ok = (
                heavy_measured
                and range(3, 4) in fused.bwd_plan
                and range(3, 4) in train.bwd_plan
                and range(3, 4) in infer.fwd_plan
            )
            if ok:
                break
        assert ok, (timer.fwd_ms, timer.bwd_ms, fused, train, infer)
        assert timer.has_measurements("fwd") and timer.has_measurements("bwd")
    finally:
        rp.close()


@pytest.mark.parametrize(
    "layout",
    [
        dict(fwd="1:2,0:2", bwd="0:1,1:2,0:2"),  # explicit owners, both sides
        dict(fwd="0:3,0:1", bwd="1:1,1:2,1:2"),  # each side on one device
        dict(fwd="2,2", bwd="1:1,0:2,1:2"),  # owners on the backward side only
    ],
)
def test_explicit_owner_plan_matches_pytorch(layout):
    from tests.core._util import mlp

    model = mlp(num_layers=5)
    x, y = torch.randn(9, 8), torch.randn(9, 4)
    loss_ref, grads_ref = reference_grads(model, x, y)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        plan = ModelExecutePlan.from_layout(
            **layout, num_layers=5, num_devices=rp.num_devices, run_type="fused"
        )
        loss = rp.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=sum_sq,
            run_config=RoundPipeRunConfig(execute_plan=plan, num_microbatch=3),
        )
        assert torch.allclose(loss, loss_ref, rtol=1e-5, atol=0)
        assert_grads_match(rp, grads_ref)
        # The pool ran each stage on its owner.
        jobs = rp.last_call.schedule
        owners = (plan.fwd_owners or [None] * len(plan.fwd_plan)) + (
            plan.bwd_owners or [None] * len(plan.bwd_plan)
        )
        for job, owner in zip(jobs, owners):
            if owner is not None:
                assert job.device == owner
    finally:
        rp.close()
