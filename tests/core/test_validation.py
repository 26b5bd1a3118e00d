"""Every plan rule of seed 000 raises a ValueError that names the offending stage or layer."""

from __future__ import annotations

import pytest

from roundpipe_core import ModelExecutePlan

pytestmark = pytest.mark.host_only

P = ModelExecutePlan


@pytest.mark.parametrize(
    "plan, run_type, message",
    [
        (P([range(0, 2)], []), "infer", "does not cover layer 2"),
        (
            P([range(0, 2), range(1, 4)], []),
            "infer",
            "layer 1 appears in fwd_plan\\[0\\] and again in fwd_plan\\[1\\]",
        ),
        (P([range(2, 4), range(0, 2)], []), "infer", "increasing"),
        (P([range(0, 2), range(2, 2), range(2, 4)], []), "infer", "fwd_plan\\[1\\].*empty"),
        (P([range(0, 4)], [range(0, 2), range(2, 4)]), "train", "decreasing"),
        (P([range(0, 4)], [range(2, 4)]), "train", "bwd_plan does not cover layer 0"),
        (P([range(0, 5)], [range(0, 4)]), "train", "outside the model's layers"),
        (
            P([range(0, 3)], [range(2, 4), range(0, 2)]),
            "fused",
            "must end where the first backward stage starts",
        ),
        (P([range(0, 2)], [range(0, 4)]), "fused", "fwd_plan must be empty"),
        (P([], [range(2, 4), range(0, 2)]), "fused", "give forward stages"),
        (P([range(0, 4)], [], fwd_owners=[0, 1]), "infer", "one owner device per stage"),
        (P([range(0, 4)], [], fwd_owners=[3]), "infer", "only 2 device"),
        (P([range(0, 4)], []), "backprop", "run_type"),
    ],
)
def test_invalid_plans(plan, run_type, message):
    with pytest.raises(ValueError, match=message):
        plan.check_valid(4, run_type, num_devices=2)


def test_non_range_stage_is_a_type_error():
    with pytest.raises(TypeError, match="fwd_plan\\[0\\] must be a range"):
        P([[0, 1, 2, 3]], []).check_valid(4, "infer")


@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
def test_uniform_plans_are_valid(run_type):
    for layers in (1, 2, 5, 9):
        for stages in (1, 2, 3, 7):
            ModelExecutePlan.uniform(layers, stages, run_type).check_valid(layers, run_type)
