"""The one-stage fused plan as one job per CPU worker at once (``ROUNDPIPE_CPU_CONCURRENT=1``).

Where CPU workers compute side by side and the model's one stage draws no random numbers
and has no buffers, a ``forward_backward`` call runs that stage as one fused job per worker,
each on its own contiguous slice of the microbatches (``Job.replicas``). The contract is
the one of the stage run as one job: loss and every gradient those of plain PyTorch, the
same bits from run to run whatever order the workers finish in, and step, accumulation and
the asynchronous step unchanged.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from _util import assert_close_rel, assert_grads_match, master_grads, mlp, reference_grads, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.context import current_microbatch
from roundpipe_core.planning.planner import _split_or_fewest
from roundpipe_core.planning.profile import LayerProfile
from roundpipe_core.planning.schedule import FUSED, build_schedule
from roundpipe_core.planning.simulate import simulated_iteration_ms

# CPU workers computing side by side is what this file is about (under fake CUDA too)
pytestmark = pytest.mark.cpu_backend


def cpu_ms(plan, prof, n, m, replicated=False):
    """The planner's estimate of a "fused" call on CPU workers that share the cores."""
    return simulated_iteration_ms(
        plan, prof, "fused", n, m, shared_cores=True, replicated=replicated
    )


ONE_STAGE = ModelExecutePlan([], [range(0, 6)])


@pytest.fixture
def concurrent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "1")


def _data(rows: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _rp(model: nn.Module, devices: int = 2, mbs: int = 4, **kw) -> RoundPipe:
    cfg = RoundPipeRunConfig(num_microbatch=mbs, execute_plan=ONE_STAGE)
    return RoundPipe(model, devices=f"cpu:{devices}", model_run_config=cfg, **kw)


def _call(rp: RoundPipe, x: torch.Tensor, y: torch.Tensor, zero: bool = True) -> torch.Tensor:
    if zero:
        for p in rp.optim_parameters():
            p.grad = None
    return rp.forward_backward((x,), label=y, loss_fn=sum_sq)


def _fused_jobs(rp: RoundPipe) -> list[tuple[int, range]]:
    """(device, microbatches) of each fused job of the last call, by what ran."""
    ran = sorted(rp.last_call.jobs, key=lambda t: t.job.index)
    assert all(t.job.kind == FUSED for t in ran)
    return [(t.device, t.job.microbatches) for t in ran]


def _warm(rp: RoundPipe, x: torch.Tensor, y: torch.Tensor) -> None:
    """A first call: the stage runs as one job, alone, and the CPU gate learns it draws
    nothing (``cpu.CLEAN_RUNS_BEFORE_SHARING``); from the next call on it may be replicated."""
    _call(rp, x, y)
    assert len(_fused_jobs(rp)) == 1


@pytest.mark.usefixtures("concurrent_env")
def test_the_stage_runs_on_both_workers_at_once_with_plain_pytorch_gradients() -> None:
    model = mlp()
    x, y = _data()
    ref_loss, ref_grads = reference_grads(model, x, y)
    rp = _rp(copy.deepcopy(model))
    try:
        _warm(rp, x, y)
        for _ in range(2):
            loss = _call(rp, x, y)
            assert _fused_jobs(rp) == [(0, range(0, 2)), (1, range(2, 4))]
            assert [j.replicas for j in rp.last_call.schedule] == [2, 2]
            assert_close_rel(loss, ref_loss, what="loss")
            assert_grads_match(rp, ref_grads)
    finally:
        rp.close()


@pytest.mark.usefixtures("concurrent_env")
def test_outputs_and_mean_losses_come_back_per_microbatch_from_both_replicas() -> None:
    model = mlp()
    x, y = _data()
    ref = copy.deepcopy(model)
    ref_out = ref(x)
    ref_loss = sum(sum_sq(o, t) / len(o) for o, t in zip(ref_out.chunk(4), y.chunk(4))) / 4
    ref_loss.backward()
    rp = _rp(copy.deepcopy(model))
    try:
        _warm(rp, x, y)
        for p in rp.optim_parameters():
            p.grad = None
        mean_sq = lambda o, t: sum_sq(o, t) / len(o)  # noqa: E731
        loss, out = rp.forward_backward(
            (x,), label=y, loss_fn=mean_sq, return_outputs=True, loss_reduction="mean"
        )
        assert len(_fused_jobs(rp)) == 2
        assert_close_rel(out, ref_out.detach(), what="outputs")
        assert_close_rel(loss, ref_loss.detach(), what="loss")
        assert_grads_match(rp, {n: p.grad for n, p in ref.named_parameters()})
    finally:
        rp.close()


@pytest.mark.usefixtures("concurrent_env")
def test_an_odd_microbatch_count_splits_unevenly_and_stays_exact() -> None:
    model = mlp()
    x, y = _data(rows=6)
    ref_loss, ref_grads = reference_grads(model, x, y)
    rp = _rp(copy.deepcopy(model), mbs=3)
    try:
        _warm(rp, x, y)
        loss = _call(rp, x, y)
        assert _fused_jobs(rp) == [(0, range(0, 2)), (1, range(2, 3))]
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref_grads)
    finally:
        rp.close()


@pytest.mark.usefixtures("concurrent_env")
def test_gradients_accumulate_over_two_replicated_calls() -> None:
    model = mlp()
    (x1, y1), (x2, y2) = _data(seed=1), _data(seed=2)
    _, g1 = reference_grads(model, x1, y1)
    _, g2 = reference_grads(model, x2, y2)
    rp = _rp(copy.deepcopy(model))
    try:
        _warm(rp, x1, y1)
        _call(rp, x1, y1)
        _call(rp, x2, y2, zero=False)
        assert len(_fused_jobs(rp)) == 2
        assert_grads_match(rp, {n: g1[n] + g2[n] for n in g1})
    finally:
        rp.close()


def _sgd_steps(model: nn.Module, batches: list, **rp_kw) -> tuple[list, list, list[int]]:
    """Blocking calls, each followed by an SGD step (``is_async`` from ``rp_kw``): the
    losses, the trained parameters and each call's number of jobs."""
    is_async = rp_kw.pop("is_async", False)
    rp = _rp(model, **rp_kw)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
    losses, replicated = [], []
    try:
        for x, y in batches:
            losses.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq))
            replicated.append(len(rp.last_call.schedule))
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        rp.synchronize()
        return losses, [p.detach().clone() for p in model.parameters()], replicated
    finally:
        rp.close()


def test_a_synchronous_step_on_shared_masters_trains_like_plain_pytorch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "1")
    model = mlp()
    batches = [_data(seed=s) for s in range(4)]
    losses, params, jobs = _sgd_steps(copy.deepcopy(model), batches, shared_masters=True)
    assert jobs == [1, 2, 2, 2]  # replicated from the second call on
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for (x, y), loss in zip(batches, losses):
        ref_loss = sum_sq(ref(x), y)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        assert_close_rel(loss, ref_loss.detach(), what="loss")
    for a, b in zip(params, ref.parameters()):
        assert_close_rel(a, b.detach(), 1e-5, "parameters")


def test_the_asynchronous_step_keeps_its_one_step_stale_math(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Separate masters, ``step(is_async=True)``: the replicated run matches the same
    blocking sequence with the stage run as one job (the switch off)."""
    model = mlp()
    batches = [_data(seed=s) for s in range(4)]
    kw = {"shared_masters": False, "is_async": True}
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "0")
    ref_losses, ref_params, ref_jobs = _sgd_steps(copy.deepcopy(model), batches, **dict(kw))
    assert ref_jobs == [1, 1, 1, 1]
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "1")
    losses, params, jobs = _sgd_steps(copy.deepcopy(model), batches, **dict(kw))
    assert jobs == [1, 2, 2, 2]
    for a, b in zip(losses, ref_losses):
        assert_close_rel(a, b, 1e-6, "losses")
    for a, b in zip(params, ref_params):
        assert_close_rel(a, b, 1e-6, "parameters")
    # the one-step-stale math is what ran: fresh weights (is_async=False) differ
    _, fresh, _ = _sgd_steps(copy.deepcopy(model), batches, shared_masters=False)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(params, fresh))


@pytest.mark.usefixtures("concurrent_env")
def test_pipelined_calls_with_the_asynchronous_step_match_the_blocking_sequence() -> None:
    model = mlp()
    batches = [_data(seed=s) for s in range(4)]
    ref_losses, ref_params, _ = _sgd_steps(
        copy.deepcopy(model), batches, shared_masters=False, is_async=True
    )
    rp = _rp(copy.deepcopy(model), shared_masters=False)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
    try:
        out, jobs = [], []
        for x, y in batches:
            out.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False))
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
            out[-1].result()
            jobs.append(len(rp.last_call.schedule))
        rp.synchronize()
        assert jobs[1:] == [2, 2, 2]
        for a, b in zip([r.result() for r in out], ref_losses):
            assert_close_rel(a, b, 1e-6, "losses")
        for a, b in zip(rp.model.parameters(), ref_params):
            assert_close_rel(a.detach(), b, 1e-6, "parameters")
    finally:
        rp.close()


class _SlowOn(nn.Module):
    """Identity that sleeps on one microbatch: its replica finishes last."""

    def __init__(self, mb: int) -> None:
        super().__init__()
        self.mb = mb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if current_microbatch() == self.mb:
            time.sleep(0.03)
        return x


def _grads_with_slow(mb: int) -> dict[str, torch.Tensor]:
    model = mlp()
    slow = _SlowOn(mb)
    model[0] = nn.Sequential(model[0], slow)
    x, y = _data(rows=12)
    rp = _rp(model, devices=3, mbs=6)
    try:
        _warm(rp, x, y)
        _call(rp, x, y)
        assert [m for _, m in _fused_jobs(rp)] == [range(0, 2), range(2, 4), range(4, 6)]
        return master_grads(rp)
    finally:
        rp.close()


@pytest.mark.usefixtures("concurrent_env")
def test_gradients_are_the_same_bits_whichever_replica_finishes_last() -> None:
    first_last = _grads_with_slow(0)  # job 0's slice finishes last
    third_last = _grads_with_slow(5)  # job 2's
    assert set(first_last) == set(third_last)
    for n in first_last:
        assert torch.equal(first_last[n], third_last[n]), n


@pytest.mark.usefixtures("concurrent_env")
@pytest.mark.parametrize("extra", [nn.BatchNorm1d(12), nn.Dropout(0.2)], ids=["bn", "dropout"])
def test_a_stage_with_buffers_or_random_numbers_stays_one_job(extra: nn.Module) -> None:
    model = mlp()
    model[2] = nn.Sequential(model[2], extra)
    x, y = _data()
    rp = _rp(model)
    try:
        for _ in range(3):
            _call(rp, x, y)
            assert len(_fused_jobs(rp)) == 1
    finally:
        rp.close()


def test_with_the_switch_off_the_stage_runs_as_one_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "0")
    model = mlp()
    x, y = _data()
    ref_loss, ref_grads = reference_grads(model, x, y)
    rp = _rp(copy.deepcopy(model))
    try:
        for _ in range(3):
            loss = _call(rp, x, y)
            assert _fused_jobs(rp) == [(0, range(0, 4))]
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref_grads)
    finally:
        rp.close()


@pytest.mark.parametrize("switch", ["", "1", "0"], ids=["default", "switch-on", "switch-off"])
@pytest.mark.parametrize("buffers", [False, True], ids=["no-buffers", "batchnorm"])
def test_the_default_microbatch_count_gives_each_worker_one(
    monkeypatch: pytest.MonkeyPatch, switch: str, buffers: bool
) -> None:
    # no num_microbatch anywhere: one per worker where the stage may be replicated (a
    # replica needs a microbatch of its own), else the CPU default, one
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", switch)
    model = mlp()
    if buffers:
        model[2] = nn.Sequential(model[2], nn.BatchNorm1d(12))
    x, y = _data(rows=9)
    ref_loss, ref_grads = reference_grads(model, x, y)
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:3")
    want = 3 if switch != "0" and not buffers else 1
    try:
        assert rp.num_microbatch_for() == want
        for _ in range(2):  # the first call runs alone while the gate learns the stage
            loss = _call(rp, x, y)
        ran = [t.job for t in rp.last_call.jobs]
        assert max(job.microbatches.stop for job in ran) == want
        assert _fused_jobs(rp) == (
            [(d, range(d, d + 1)) for d in range(3)] if want == 3 else [(0, range(0, 1))]
        )
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref_grads)
    finally:
        rp.close()


def test_the_default_count_stays_once_draws_are_learned(monkeypatch: pytest.MonkeyPatch) -> None:
    # a model with Dropout: its stage draws random numbers, so it runs as one job once a
    # call has shown that -- but the default microbatch count rests on the structure only
    # and stays one per worker (a count that changed after the first call would change
    # the cut of every batch, and the plan cached for it)
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "1")
    model = mlp()
    model[1] = nn.Sequential(model[1], nn.Dropout(0.1))
    x, y = _data(rows=9)
    rp = RoundPipe(model, devices="cpu:3")
    try:
        counts = [rp.num_microbatch_for()]
        for _ in range(2):
            _call(rp, x, y)
            counts.append(rp.num_microbatch_for())
        assert counts == [3, 3, 3]
        assert max(t.job.microbatches.stop for t in rp.last_call.jobs) == 3
        assert _fused_jobs(rp) == [(0, range(0, 3))]  # it draws: one job, not replicated
    finally:
        rp.close()


def test_the_schedule_replicates_only_a_lone_fused_stage() -> None:
    jobs = build_schedule(ONE_STAGE, "fused", 2, 5, start_device=1, replicas=2)
    assert [(j.device, j.microbatches, j.replica, j.code) for j in jobs] == [
        (1, range(0, 3), 0, "0X1"),
        (0, range(3, 5), 1, "0X0"),
    ]
    # never more jobs than devices or microbatches
    assert len(build_schedule(ONE_STAGE, "fused", 2, 1, replicas=2)) == 1
    assert len(build_schedule(ONE_STAGE, "fused", 3, 8, replicas=5)) == 3
    two = ModelExecutePlan([], [range(3, 6), range(0, 3)])
    assert [j.replicas for j in build_schedule(two, "fused", 2, 4, replicas=2)] == [1, 1]
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        build_schedule(ONE_STAGE, "fused", 2, 4, replicas=0)


def test_the_planner_charges_the_replicated_stage_its_longest_slice() -> None:
    prof = LayerProfile(fwd_ms=[1.0] * 16, bwd_ms=[2.0] * 16)
    one = ModelExecutePlan([], [range(0, 16)])
    alone = cpu_ms(one, prof, 2, 16)  # one job, alone: 16 x 48 ms
    assert alone == pytest.approx(16 * 48.0)
    # each worker runs 8 of the 16 microbatches, SHARED_CORES_SLOWDOWN slower
    assert cpu_ms(one, prof, 2, 16, replicated=True) == pytest.approx(8 * 48.0 * 1.5)
    assert cpu_ms(one, prof, 2, 3, replicated=True) == pytest.approx(2 * 48.0 * 1.5)
    # a split plan wins over the stage run as one job, not over the replicated stage
    assert _split_or_fewest(one, prof, 16).fwd_plan
    assert _split_or_fewest(one, prof, 16, replicated=True) == one


@pytest.mark.usefixtures("concurrent_env")
def test_a_gradient_hook_sees_each_master_once_with_both_replicas_summed() -> None:
    """``register_grad_hook`` (the data-parallel reducer's overlap) fires for a master once
    every replica of its stage is in, never after the first one alone."""
    model = mlp()
    x, y = _data()
    _, ref_grads = reference_grads(model, x, y)
    rp = _rp(copy.deepcopy(model))
    names = {id(p): n for n, p in rp.optim_named_parameters()}
    seen: list[tuple[str, torch.Tensor]] = []
    try:
        _warm(rp, x, y)
        rp.register_grad_hook(lambda ms: seen.extend((names[id(m)], m.grad.clone()) for m in ms))
        _call(rp, x, y)
        assert len(_fused_jobs(rp)) == 2
        assert sorted(n for n, _ in seen) == sorted(ref_grads)  # each master once
        for n, g in seen:
            assert_close_rel(g, ref_grads[n], what=n)
    finally:
        rp.close()


class _Ticks:
    """A worker whose time points are seconds, as the CPU backend's."""

    index = 0
    time_points_are_seconds = True


def test_the_layer_timer_stays_per_microbatch_with_replicas() -> None:
    """Two replicas of a stage, two microbatches each at 10 ms a layer: the timer, which
    adds a layer's records of one iteration, reads 10 ms per microbatch, as for the stage
    run as one job over four."""
    from roundpipe_core.running.replicas import replica_microbatches
    from roundpipe_core.running.timer import CallTiming, JobClock, ModelTimer

    jobs = build_schedule(ModelExecutePlan([], [range(0, 2)]), "fused", 2, 4, replicas=2)
    timer = ModelTimer([nn.Linear(2, 2), nn.Linear(2, 2)])
    for _ in range(2):  # the timer drops its first iteration (warm-up)
        timing = CallTiming()
        for job in jobs:
            clock = JobClock(_Ticks())  # type: ignore[arg-type]
            for mb in job.microbatches:
                t = mb * 0.1
                clock.marks += [("fwd", 0, 1, t, t + 0.01), ("fwd", 1, 2, t + 0.01, t + 0.02)]
            clock.end_job(job, replica_microbatches(job), 0.0)
            timing.add(clock)
        timing.commit(timer)
    assert timer.fwd_ms == pytest.approx([10.0, 10.0])
