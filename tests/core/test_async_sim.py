"""The simulator's hand-off between overlapped iterations and the host step: weights
published per layer, and a step taken layer by layer as gradients complete."""

from __future__ import annotations

import pytest

from roundpipe_core import ModelExecutePlan as P
from roundpipe_core.planning.simulate import simulate

pytestmark = pytest.mark.host_only

FWD, BWD = [1.0] * 8, [2.0] * 8


def _run(step_ms: float, per_layer: bool, share=None, iterations: int = 8):
    plan = P.uniform(8, 8, "fused")
    return simulate(
        plan,
        FWD,
        BWD,
        4,
        5,
        iterations=iterations,
        overlap_iterations=True,
        step_ms=step_ms,
        step_per_layer=per_layer,
        step_share=share,
    )


def _first_start(res, it: int, layer: int) -> float:
    return min(
        e.start
        for e in res.events
        if e.iteration == it and e.kind != "upload" and layer in _layers_of(res, e)
    )


def _layers_of(res, e):
    return next(j.layers for j in res.jobs if j.index == e.job)


def test_no_step_time_gives_the_same_timeline_either_way():
    a, b = _run(0.0, False), _run(0.0, True)
    assert a.iteration_ms == pytest.approx(b.iteration_ms)
    assert [(e.start, e.end) for e in a.events] == [(e.start, e.end) for e in b.events]


def test_a_per_layer_step_hides_a_step_of_half_an_iteration():
    alone = _run(0.0, False).iteration_ms
    one_call = _run(0.5 * alone * 2, False).iteration_ms
    per_layer = _run(0.5 * alone * 2, True).iteration_ms
    assert per_layer < one_call - 1e-6  # the lever: deep layers step while the tail runs
    assert per_layer == pytest.approx(alone, rel=1e-6)  # ... fully hidden here
    for step in (0.0, 3.0, 10.0, 40.0, 80.0):
        assert _run(step, True).iteration_ms <= _run(step, False).iteration_ms + 1e-9


def test_a_long_step_is_the_pace_on_one_thread():
    step = 200.0
    for per_layer in (False, True):
        res = _run(step, per_layer, iterations=10)
        # iteration k + 2 needs step k and steps run one after another
        assert res.iteration_ms * 10 >= step * (10 - 2) - 1e-6


def test_iteration_k_plus_2_waits_for_the_step_of_its_layers():
    """With the step per layer, iteration 2's first job (layer 0) waits for layer 0's
    step, which follows iteration 0's last gradient (layer 0's); with one step call,
    iteration 2 waits for the whole step."""
    share = [1.0] * 8
    res = _run(16.0, True, share=share, iterations=3)
    end0 = max(e.end for e in res.events if e.iteration == 0)
    # layer 0 is the last to get its gradient; its share of the step (2.0) follows
    assert _first_start(res, 2, 0) >= end0 + 2.0 - 1e-9
    one = _run(16.0, False, iterations=3)
    # one step call: nothing of iteration 2 before the whole step is done
    end0_one = max(e.end for e in one.events if e.iteration == 0)
    assert min(e.start for e in one.events if e.iteration == 2) >= end0_one + 16.0 - 1e-9


def test_bad_step_share():
    with pytest.raises(ValueError, match="step_share"):
        _run(1.0, True, share=[0.0] * 8)
    with pytest.raises(ValueError, match="step_share"):
        _run(1.0, True, share=[1.0] * 7)
