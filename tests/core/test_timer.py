"""ModelTimer statistics on synthetic timings."""

from __future__ import annotations

import threading

import pytest
from torch import nn

from roundpipe_core.running.timer import ModelTimer

pytestmark = pytest.mark.host_only


def make_layers() -> list[nn.Module]:
    # Sizes 1 : 4 : 0 (ReLU has no parameters).
    return [nn.Linear(10, 10, bias=False), nn.Linear(20, 20, bias=False), nn.ReLU()]


def test_layer_bytes_count_params_and_buffers():
    bn = nn.BatchNorm1d(8)  # 16 params + 16 running stats + 1 counter
    timer = ModelTimer([nn.Linear(3, 4), bn])
    assert timer.layer_param_bytes == [(12 + 4) * 4, 16 * 4 + 16 * 4 + 8]
    assert timer.layer_grad_bytes == [(12 + 4) * 4, 16 * 4]


def test_shared_parameters_counted_once():
    lin = nn.Linear(4, 4, bias=False)
    seq = nn.Sequential(lin)
    seq.add_module("again", lin)
    timer = ModelTimer([seq])
    assert timer.layer_param_bytes == [16 * 4]


def test_prior_is_size_proportional_with_backward_twice_forward():
    timer = ModelTimer(make_layers())
    fwd = timer.fwd_ms
    assert fwd[1] == pytest.approx(4 * fwd[0])
    assert 0 < fwd[2] < fwd[0]  # parameter-free layers are not free
    assert timer.re_ms == fwd
    assert timer.bwd_ms == pytest.approx([2 * x for x in fwd])
    assert not timer.has_measurements()


def test_first_iteration_dropped_then_bias_corrected_ema():
    timer = ModelTimer([nn.Linear(2, 2)])
    prior = timer.fwd_ms[0]
    timer.record("fwd", range(0, 1), 100.0)
    timer.end_iteration()
    assert timer.fwd_ms[0] == prior  # warm-up iteration dropped
    timer.record("fwd", range(0, 1), 10.0)
    timer.end_iteration()
    assert timer.fwd_ms[0] == pytest.approx(10.0)  # bias correction: not 1.0
    timer.record("fwd", range(0, 1), 20.0)
    timer.end_iteration()
    # EMA: (0.9 * 0.1 * 10 + 0.1 * 20) / (1 - 0.81)
    assert timer.fwd_ms[0] == pytest.approx((0.09 * 10 + 0.1 * 20) / 0.19)
    xs = [10.0, 20.0] + [30.0] * 200
    timer2 = ModelTimer([nn.Linear(2, 2)])
    for x in [999.0] + xs:
        timer2.record("fwd", [0], x)
        timer2.end_iteration()
    assert timer2.fwd_ms[0] == pytest.approx(30.0)


def test_records_of_one_iteration_add_up():
    timer = ModelTimer([nn.Linear(2, 2)])
    for _ in range(2):
        timer.record("bwd", [0], 3.0)
        timer.record("bwd", [0], 4.0)
        timer.end_iteration()
    assert timer.bwd_ms[0] == pytest.approx(7.0)


def test_per_microbatch_normalisation():
    timer = ModelTimer([nn.Linear(2, 2)])
    for mbs in (3, 3, 6):  # the first iteration is dropped
        timer.record("fwd", [0], 2.0 * mbs, microbatches=mbs)
        timer.end_iteration()
    assert timer.fwd_ms[0] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="microbatches"):
        timer.record("fwd", [0], 1.0, microbatches=0)


def test_unmeasured_kinds_follow_measured_forward():
    timer = ModelTimer([nn.Linear(2, 2)])
    for _ in range(2):
        timer.record("fwd", [0], 5.0)
        timer.end_iteration()
    assert timer.re_ms == [pytest.approx(5.0)]
    assert timer.bwd_ms == [pytest.approx(10.0)]
    assert timer.has_measurements("fwd") and not timer.has_measurements("bwd")


def test_multi_layer_records_apportioned():
    timer = ModelTimer(make_layers())
    prior = timer.fwd_ms
    for _ in range(2):
        timer.record("fwd", range(0, 3), 60.0)
        timer.end_iteration()
    # Forward split in proportion to the current forward estimates (the prior here).
    total = sum(prior)
    assert timer.fwd_ms == pytest.approx([60.0 * p / total for p in prior])
    # Teach recompute times: layer 1 measured alone is 9x layer 0.
    for _ in range(2):
        timer.record("re", [0], 1.0)
        timer.record("re", [1], 9.0)
        timer.record("re", [2], 0.0)
        timer.end_iteration()
    # Backward of a multi-layer stage is split by recompute times.
    for _ in range(2):
        timer.record("bwd", range(0, 3), 50.0)
        timer.end_iteration()
    assert timer.bwd_ms == pytest.approx([5.0, 45.0, 0.0])
    assert timer.stage_ms("backward", range(0, 2)) == pytest.approx(1 + 9 + 5 + 45)
    assert timer.stage_ms("bwd", [1]) == pytest.approx(45.0)
    assert timer.stage_ms("fused", [0]) == pytest.approx(timer.fwd_ms[0] + 5.0)


def test_verbose_prints_updates(capsys):
    timer = ModelTimer([nn.Linear(2, 2)] * 1 + [nn.Linear(2, 2)] * 3)
    old = ModelTimer.VERBOSE
    ModelTimer.VERBOSE = True
    try:
        timer.record("fwd", [3], 1.0)
        timer.record("re", [3], 1.0)
        timer.end_iteration()
        assert capsys.readouterr().err == ""  # dropped warm-up: nothing changed
        timer.record("fwd", [3], 1.234)
        timer.record("re", [3], 2.0)
        timer.end_iteration()
    finally:
        ModelTimer.VERBOSE = old
    err = capsys.readouterr().err.splitlines()
    assert "Layer 3 fwd  new record: 1.234 ms  new estimate: 1.234 ms" in err
    assert "Layer 3 re   new record: 2.000 ms  new estimate: 2.000 ms" in err


def test_bad_input_rejected():
    timer = ModelTimer(make_layers())
    with pytest.raises(ValueError, match="kind"):
        timer.record("forward", [0], 1.0)
    with pytest.raises(ValueError, match="layer 5"):
        timer.record("fwd", [5], 1.0)
    with pytest.raises(ValueError, match="finite"):
        timer.record("fwd", [0], float("nan"))
    with pytest.raises(ValueError, match="finite"):
        timer.record("fwd", [0], float("inf"))
    with pytest.raises(ValueError, match="finite"):
        timer.record("fwd", [0], -1.0)
    with pytest.raises(ValueError, match="at least one layer"):
        ModelTimer([])


def test_state_dict_round_trip_and_reset():
    timer = ModelTimer(make_layers())
    for x in (1.0, 2.0, 3.0):
        timer.record("fwd", [1], x)
        timer.end_iteration()
    other = ModelTimer(make_layers())
    other.load_state_dict(timer.state_dict())
    assert other.fwd_ms == timer.fwd_ms
    with pytest.raises(ValueError, match="layers"):
        ModelTimer([nn.ReLU()]).load_state_dict(timer.state_dict())
    timer.reset()
    assert timer.fwd_ms == ModelTimer(make_layers()).fwd_ms


def test_concurrent_records_are_not_lost():
    timer = ModelTimer([nn.Linear(2, 2) for _ in range(4)])

    def work(layer: int) -> None:
        for _ in range(500):
            timer.record("fwd", [layer], 0.01)

    for _ in range(2):
        threads = [threading.Thread(target=work, args=(i % 4,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        timer.end_iteration()
    # 2 threads per layer x 500 records x 0.01 ms
    assert timer.fwd_ms == pytest.approx([10.0] * 4)


def test_sequential_accepted():
    timer = ModelTimer(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert timer.num_layers == 2
