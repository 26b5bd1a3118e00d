"""The default plan is re-planned once, from averages over several measured iterations,
and switched only for a predicted gain: noise cannot make identical models flip plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe
from roundpipe_core.plan_choice import PlanChoice
from roundpipe_core.planning import planner as planner_module
from tests.core._util import sum_sq

A = ModelExecutePlan.uniform(8, 2, "fused")
B = ModelExecutePlan.uniform(8, 4, "fused")


def _run(monkeypatch: pytest.MonkeyPatch, gain: float) -> tuple[list[ModelExecutePlan], int]:
    """Train 8 steps; the planner answers A from estimates and B once anything is measured.
    Returns the plan each call ran and how often the planner was asked."""
    asked = []

    def planner(run_type, rp, **options):
        asked.append(rp.model_timer.measured_iterations())
        return B if rp.model_timer.has_measurements() else A

    monkeypatch.setattr(ModelExecutePlan, "_planner", staticmethod(planner))
    # the re-plan policy (planner.decide_replan) asks the simulator through this name
    monkeypatch.setattr(planner_module, "predicted_speedup", lambda *a, **k: gain)
    torch.manual_seed(0)
    rp = RoundPipe(nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]), devices="cpu:2")
    used = []
    try:
        x, y = torch.randn(6, 8), torch.randn(6, 8)
        for _ in range(8):
            used.append(rp.plan_for("fused"))
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
    finally:
        rp.close()
    return used, len(asked)


def test_not_replanned_before_enough_measured_iterations(monkeypatch) -> None:
    used, asked = _run(monkeypatch, gain=2.0)
    after = PlanChoice.DEFAULT_REPLAN_AFTER
    # call 0: estimates; the first measured iteration is dropped, so call k's plan rests on
    # k - 1 measured iterations: A until `after` of them exist, then B for good
    assert used[: after + 1] == [A] * (after + 1)
    assert used[after + 1 :] == [B] * (8 - after - 1)
    # planned from estimates (plan_for), again once the first training call measured
    # the activations, and once from the settled averages
    assert asked == 3


def test_a_small_predicted_gain_keeps_the_first_plan(monkeypatch) -> None:
    used, asked = _run(monkeypatch, gain=1.0 + PlanChoice.DEFAULT_REPLAN_MIN_GAIN / 2)
    assert used == [A] * 8
    assert asked == 3  # as above; settled: not asked again on every call


@pytest.mark.parametrize(("gain", "changed"), [(1.02, False), (2.0, True)])
def test_replan_follows_the_same_policy(monkeypatch, gain, changed) -> None:
    """RoundPipe.replan (what AutoReplan calls) takes the planner's plan only for a
    predicted gain of at least min_gain, the rule the default plan's re-plan follows."""
    monkeypatch.setattr(ModelExecutePlan, "_planner", staticmethod(lambda *a, **k: B))
    monkeypatch.setattr(planner_module, "predicted_speedup", lambda *a, **k: gain)
    rp = RoundPipe(nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]), devices="cpu:2")
    try:
        rp.set_plan("fused", A)
        decision = rp.replan("fused", min_gain=0.05)
        assert (decision.old, decision.candidate, decision.gain) == (A, B, gain)
        assert decision.changed is changed
        assert rp.plan_for("fused") == (B if changed else A)
        if changed:  # the planner now picks the plan in use: no gain, no change
            again = rp.replan("fused", min_gain=0.0)
            assert again.gain == 1.0 and not again.changed
    finally:
        rp.close()


def test_replan_of_the_same_plan_predicts_no_gain() -> None:
    decision = planner_module.decide_replan(A, A, None, "fused", 2, 3, 0.0)
    assert decision.gain == 1.0 and not decision.changed and decision.plan == A


@pytest.mark.parametrize(("asked", "simulated"), [(None, False), (True, True)])
def test_replan_judges_the_gain_on_the_device_model_it_planned_for(
    monkeypatch, asked, simulated
) -> None:
    """CPU workers compute one at a time; replan(concurrent=True) plans and judges as for
    devices that overlap, the default (the pool's) as for CPU workers."""
    seen = {}

    def planner(run_type, rp, **options):
        seen["planned"] = options["concurrent"]
        return B

    def speedup(*a, concurrent=True, **k):
        seen["judged"] = concurrent
        return 2.0

    monkeypatch.setattr(ModelExecutePlan, "_planner", staticmethod(planner))
    monkeypatch.setattr(planner_module, "predicted_speedup", speedup)
    rp = RoundPipe(nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]), devices="cpu:2")
    try:
        rp.set_plan("fused", A)
        kwargs = {} if asked is None else {"concurrent": asked}
        rp.replan("fused", **kwargs)
        assert seen == {"planned": simulated, "judged": simulated}
    finally:
        rp.close()
