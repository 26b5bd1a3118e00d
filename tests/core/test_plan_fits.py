"""A plan the user chose is checked against the smallest device's memory before the call
runs, once per plan; the activation bytes it needs are measured once and reach the planner."""

from __future__ import annotations

import pytest
import torch
from _util import sum_sq
from torch import nn

import roundpipe_core.checks as checks
from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.planning.profile import layer_sizes, profile_of


def _wide(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def _set_capacity(rp: RoundPipe, nbytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    for w in rp.pool.workers:
        monkeypatch.setattr(w, "memory_capacity", lambda: nbytes)


def _one_stage() -> ModelExecutePlan:
    plan = ModelExecutePlan()  # fused: the one backward stage runs the forward too
    plan.fwd_plan = []
    plan.bwd_plan = [range(0, 5)]
    return plan


def test_a_manual_plan_that_cannot_fit_is_refused_naming_the_stage(monkeypatch) -> None:
    model = _wide()
    sizes = layer_sizes(list(model))
    weights = sum(sizes.upload_bytes) + sum(sizes.grad_bytes)
    x, y = torch.randn(64, 8), torch.randn(64, 4)
    rp = RoundPipe(model, devices=2)
    try:
        # parameters and gradients fit; with the activations of a 32-row microbatch they do not
        _set_capacity(rp, weights + 1024, monkeypatch)
        cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=_one_stage())
        with pytest.raises(ValueError, match=r"stage 0 \(layers 0\.\.4\).*activations"):
            rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq, run_config=cfg)
        assert all(p.grad is None for p in rp.optim_parameters())  # refused before compute
        act = rp.layer_activation_bytes
        assert act is not None and len(act) == 5 and sum(act) > 1024
        # the planner now counts them too
        assert list(profile_of(rp).act_bytes) == act
        # with room for them the same plan runs
        _set_capacity(rp, 10 * (weights + int(sum(act))), monkeypatch)
        rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq, run_config=cfg)
    finally:
        rp.close()


def test_set_plan_is_checked_once_per_plan(monkeypatch) -> None:
    calls: list[object] = []
    real = checks.check_plan_fits

    def counting(plan, *a, **k):
        calls.append(plan)
        return real(plan, *a, **k)

    monkeypatch.setattr(checks, "check_plan_fits", counting)
    rp = RoundPipe(_wide(), devices=2)
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    try:
        rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
        assert calls == []  # the automatic plan is planned within the memory limit already
        rp.set_plan("fused", _one_stage())
        for _ in range(3):
            rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
        assert len(calls) == 1
        two = ModelExecutePlan()
        two.fwd_plan = [range(0, 2)]
        two.bwd_plan = [range(2, 5), range(0, 2)]
        rp.set_plan("fused", two)
        rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
        assert len(calls) == 2
    finally:
        rp.close()


def test_the_measuring_forward_leaves_no_trace() -> None:
    # dropout draws and BatchNorm statistics are those of a run without the measurement
    def build() -> nn.Sequential:
        torch.manual_seed(1)
        return nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 4)
        )

    x, y = torch.randn(12, 8), torch.randn(12, 4)
    results = []
    for measured in (False, True):
        model = build()
        rp = RoundPipe(model, devices=2)
        try:
            # the same manual plan both times (dropout streams follow the stages);
            # bytes given by hand skip the measurement
            plan = ModelExecutePlan()
            plan.fwd_plan = [range(0, 2)]
            plan.bwd_plan = [range(2, 4), range(0, 2)]
            rp.set_plan("fused", plan)
            if not measured:
                rp.layer_activation_bytes = [0.0] * 4
            torch.manual_seed(7)
            loss = rp.forward_backward(
                input_args=(x,),
                label=y,
                loss_fn=sum_sq,
                run_config=RoundPipeRunConfig(num_microbatch=3),
            )
            after = torch.rand(1)  # the caller's random stream continues where it was
            rp.synchronize()
            results.append((loss, after, model[1].running_mean.clone()))
            assert rp.layer_activation_bytes is not None
            assert (sum(rp.layer_activation_bytes) > 0) == measured
        finally:
            rp.close()
    (l0, r0, m0), (l1, r1, m1) = results
    assert torch.equal(l0, l1) and torch.equal(r0, r1) and torch.equal(m0, m1)


def test_given_activation_bytes_replace_the_measurement(monkeypatch) -> None:
    rp = RoundPipe(_wide(), devices=2)
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    try:
        with pytest.raises(ValueError, match="one per layer"):
            rp.layer_activation_bytes = [1.0, 2.0]
        rp.layer_activation_bytes = [10**15, 0, 0, 0, 0]  # a petabyte: no device holds it
        with pytest.raises(ValueError, match="activations"):
            rp.forward_backward(
                input_args=(x,),
                label=y,
                loss_fn=sum_sq,
                run_config=RoundPipeRunConfig(execute_plan=_one_stage()),
            )
        assert rp.layer_activation_bytes == [1e15, 0.0, 0.0, 0.0, 0.0]  # not measured over
    finally:
        rp.close()


class _Expand(nn.Module):
    """Few weights, many saved activations: a 64-wide layer that works 32x wider inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.tanh(self.lin(x).repeat(1, 32))  # saved for the backward of tanh
        return wide.view(x.shape[0], 32, 64).mean(1)


def test_the_default_plan_counts_the_first_training_calls_activations(monkeypatch) -> None:
    from roundpipe_core.planning.planner import DEFAULT_MEMORY_SHARE
    from roundpipe_core.planning.profile import loss_transient_bytes, stage_memory

    torch.manual_seed(0)
    model = nn.Sequential(*[_Expand() for _ in range(4)])
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    sizes = layer_sizes(list(model))
    weights = sum(sizes.upload_bytes) + sum(sizes.grad_bytes)
    rp = RoundPipe(model, devices=2)
    try:
        # parameters and gradients of all four layers fit one stage many times over;
        # one microbatch's activations (about 1.3 MiB: 32 rows x 8 KiB per layer, and
        # layer 0 keeps its input batch) do not
        # a stage may use half the limit (the other half: the next stage's prefetch),
        # or all of it where uploads lend the host's parameters (CPU workers)
        halves = 1 if rp.uploads_lend_parameters else 2
        capacity = int(halves * max(5 * weights, 700_000) / DEFAULT_MEMORY_SHARE)
        _set_capacity(rp, capacity, monkeypatch)
        cfg = RoundPipeRunConfig(num_microbatch=2)
        rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq, run_config=cfg)
        act = rp.layer_activation_bytes
        assert act is not None, "a default plan's first training call measures activations"
        # the loss's transient is on the last layer: its output and two fp32 copies
        out_bytes = 32 * 64 * 4
        assert act[-1] - act[1] == pytest.approx(loss_transient_bytes(torch.ones(32, 64)))
        assert loss_transient_bytes(torch.ones(32, 64)) == 3 * out_bytes
        plan = rp.plan_for("fused")
        cap = DEFAULT_MEMORY_SHARE * capacity / halves
        stages = stage_memory(plan, profile_of(rp), "fused")
        assert len(plan.bwd_plan) > 1, plan  # split for the activations
        assert all(s.total_bytes <= cap for s in stages), (stages, cap)
    finally:
        rp.close()
