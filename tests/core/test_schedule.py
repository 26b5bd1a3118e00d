"""The schedule as data: round-robin dispatch, owners, launch order."""

from __future__ import annotations

import pytest
import torch
from _util import mlp, sum_sq

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.planning.schedule import (
    BACKWARD,
    FORWARD,
    FUSED,
    boundary_layers,
    build_schedule,
    jobs_by_device,
)

P = ModelExecutePlan


def test_round_robin_over_forward_fused_and_backward():
    plan = P([range(0, 3), range(3, 5)], [range(5, 6), range(4, 5), range(2, 4), range(0, 2)])
    jobs = build_schedule(plan, "fused", 3, 4)
    assert [j.kind for j in jobs] == [FORWARD, FORWARD, FUSED, BACKWARD, BACKWARD, BACKWARD]
    assert [j.device for j in jobs] == [0, 1, 2, 0, 1, 2]
    assert [j.layers for j in jobs] == plan.fwd_plan + plan.bwd_plan
    assert all(j.microbatches == range(4) for j in jobs)
    assert [len(q) for q in jobs_by_device(jobs, 3)] == [2, 2, 2]


def test_train_phases_continue_the_rotation():
    plan = P([range(0, 2), range(2, 4)], [range(3, 4), range(1, 3), range(0, 1)])
    fwd = build_schedule(plan, "train", 2, 2, phase="forward")
    bwd = build_schedule(plan, "train", 2, 2, phase="backward", start_device=len(fwd) % 2)
    assert [j.device for j in fwd] == [0, 1] and [j.device for j in bwd] == [0, 1, 0]
    assert all(j.kind == BACKWARD for j in bwd)


def test_owners_pin_stages():
    plan = P(
        [range(0, 4), range(4, 7)],
        [range(7, 9), range(4, 7), range(0, 4)],
        fwd_owners=[0, 0],
        bwd_owners=[1, 1, 0],
    )
    jobs = build_schedule(plan, "fused", 2, 3)
    assert [j.device for j in jobs] == [0, 0, 1, 1, 0]


def test_boundaries_are_backward_stage_inputs():
    plan = P([range(0, 3), range(3, 5)], [range(5, 6), range(4, 5), range(2, 4), range(0, 2)])
    assert boundary_layers(plan, "fused") == {5, 4, 2, 0}
    assert boundary_layers(plan, "infer") == set()


@pytest.mark.parametrize("bad", [0, -1])
def test_schedule_rejects_bad_sizes(bad):
    with pytest.raises(ValueError):
        build_schedule(P([range(0, 2)], []), "infer", bad, 1)
    with pytest.raises(ValueError):
        build_schedule(P([range(0, 2)], []), "infer", 1, bad)


def test_engine_runs_the_schedule_it_built_on_the_owner_devices():
    model = mlp()
    plan = P([range(0, 3)], [range(3, 6), range(0, 3)], fwd_owners=[1], bwd_owners=[1, 0])
    rp = RoundPipe(model, devices="cpu:2")
    try:
        rp.forward_backward(
            (torch.randn(4, 8),),
            label=torch.randn(4, 4),
            loss_fn=sum_sq,
            run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
        )
        assert [j.device for j in rp.last_call.schedule] == [1, 1, 0]
        ran = sorted((t.job.index, t.device) for t in rp.last_call.jobs)
        assert ran == [(0, 1), (1, 1), (2, 0)]
    finally:
        rp.close()
