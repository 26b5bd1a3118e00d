"""The engine's hooks for adapters: loss multiplier, the caller's autocast on the
workers, per-run-type plans and the last call's wall time / batch size."""

from __future__ import annotations

import copy

import pytest
import torch
from _util import (
    assert_close_rel,
    assert_grads_match,
    master_grads,
    mlp,
    reference_grads,
    sum_sq,
)
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

P = ModelExecutePlan


def _data(batch: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)


# -- loss multiplier ----------------------------------------------------------------------
@pytest.mark.parametrize("blocking", [True, False])
def test_loss_multiplier_scales_gradients_not_the_returned_loss(blocking: bool) -> None:
    model = mlp()
    x, y = _data()
    plain = RoundPipe(copy.deepcopy(model), devices="cpu:2")
    scaled = RoundPipe(copy.deepcopy(model), devices="cpu:2")
    calls: list[int] = []

    def multiplier() -> float:
        calls.append(1)
        return 0.25

    scaled.loss_multiplier = multiplier
    try:
        ref_loss, ref_out = plain.forward_backward(
            (x,), label=y, loss_fn=sum_sq, return_outputs=True
        )
        result = scaled.forward_backward(
            (x,), label=y, loss_fn=sum_sq, return_outputs=True, blocking=blocking
        )
        loss, out = result if blocking else result.result(timeout=60)
        assert calls == [1]  # consulted once per call, not per microbatch
        assert torch.equal(loss, ref_loss)  # the unmultiplied loss
        assert torch.equal(out, ref_out)
        ref = {n: g * 0.25 for n, g in master_grads(plain).items()}
        assert_grads_match(scaled, ref)
    finally:
        plain.close()
        scaled.close()


def test_loss_multiplier_must_return_a_number() -> None:
    rp = RoundPipe(mlp(), devices="cpu:2")
    rp.loss_multiplier = lambda: "half"  # type: ignore[assignment,return-value]
    x, y = _data()
    try:
        with pytest.raises(TypeError, match="loss_multiplier"):
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
    finally:
        rp.close()


# -- autocast -------------------------------------------------------------------------------
# The caller enters the autocast of the workers' device type (CPU workers here; CUDA
# workers under ROUNDPIPE_TEST_DEVICE=cuda), and the reference runs on that device.
def _worker_device(rp: RoundPipe) -> torch.device:
    return rp.pool.workers[0].device


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, what
    if got.device.type == "cpu" and want.device.type == "cpu":
        assert torch.equal(got, want), what  # the same kernels on the same inputs
    else:
        assert_close_rel(got.float().cpu(), want.float().cpu(), rel=1e-2, what=what)


def test_forward_under_caller_autocast_matches_pytorch_dtype() -> None:
    model = mlp()
    x, _ = _data()
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:2")
    dev = _worker_device(rp)
    try:
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
            ref = model.to(dev)(x.to(dev))
            out = rp(x)
        assert out.dtype == torch.bfloat16
        _assert_same(out, ref.cpu(), "output")
        with torch.no_grad():
            assert rp(x).dtype == torch.float32  # outside the autocast: nothing is entered
    finally:
        rp.close()


def _bf16_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dev: torch.device):
    ref = copy.deepcopy(model).to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        out = ref(x.to(dev))
        loss = sum_sq(out.float(), y.to(dev))
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in ref.named_parameters()}
    return loss.detach().cpu(), out.detach().cpu(), grads


def _sum_sq_f32(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return sum_sq(out.float(), y)


def test_forward_backward_under_caller_autocast_matches_pytorch() -> None:
    model = mlp()
    x, y = _data()
    rp = RoundPipe(model, devices="cpu:2")
    ref_loss, ref_out, ref = _bf16_reference(model, x, y, _worker_device(rp))
    try:
        with torch.autocast(_worker_device(rp).type, dtype=torch.bfloat16):
            loss, out = rp.forward_backward(
                (x,),
                label=y,
                loss_fn=_sum_sq_f32,
                return_outputs=True,
                run_config=RoundPipeRunConfig(num_microbatch=1),
            )
        assert out.dtype == torch.bfloat16
        _assert_same(out, ref_out, "output")
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref)
    finally:
        rp.close()


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_forward_with_autograd_under_caller_autocast_matches_pytorch(grain: str) -> None:
    """The recompute in backward runs under the autocast its forward ran under."""
    model = mlp()
    x, y = _data()
    rp = RoundPipe(model, devices="cpu:2")
    dev = _worker_device(rp)
    ref_loss, ref_out, ref = _bf16_reference(model, x, y, dev)
    try:
        cfg = RoundPipeRunConfig(num_microbatch=1, recompute_grain=grain)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = rp(x, roundpipe_run_config=cfg)
            loss = sum_sq(out.float(), y)
        assert out.dtype == torch.bfloat16
        _assert_same(out.detach(), ref_out, "output")
        loss.backward()  # outside the autocast: the recompute must still use it
        assert_close_rel(loss.detach(), ref_loss, what="loss")
        assert_grads_match(rp, ref)
    finally:
        rp.close()


# -- per-run-type plans ---------------------------------------------------------------------
def test_plan_precedence() -> None:
    fused_a = P([range(0, 3)], [range(3, 6), range(0, 3)])
    fused_b = P([range(0, 2)], [range(2, 6), range(0, 2)])
    fused_c = P([], [range(0, 6)])
    rp = RoundPipe(
        mlp(), devices="cpu:2", model_run_config=RoundPipeRunConfig(execute_plan=fused_a)
    )
    x, y = _data()
    try:
        assert rp.plan_for("fused") is fused_a  # model_run_config's beats the default
        rp.set_plan("fused", fused_b)
        assert rp.plan_for("fused") is fused_b  # set_plan's beats model_run_config's
        assert rp.plan_for("fused", RoundPipeRunConfig(execute_plan=fused_c)) is fused_c
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert {j.layers for j in rp.last_call.schedule} == set(fused_b.fwd_plan + fused_b.bwd_plan)
        rp.set_plan("fused", None)
        assert rp.plan_for("fused") is fused_a
        with pytest.raises(ValueError, match="run_type"):
            rp.set_plan("training", fused_b)
        with pytest.raises(ValueError):
            rp.set_plan("infer", fused_b)  # a fused plan is not valid for inference
        with pytest.raises(TypeError, match="ModelExecutePlan"):
            rp.set_plan("fused", "6")  # type: ignore[arg-type]
    finally:
        rp.close()


def test_plan_for_default_is_the_default_plan() -> None:
    rp = RoundPipe(mlp(), devices="cpu:2")
    try:
        assert rp.plan_for("infer") is rp.default_plan("infer")
    finally:
        rp.close()


# -- last call --------------------------------------------------------------------------------
def test_last_call_fields() -> None:
    rp = RoundPipe(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)), devices="cpu:2")
    ids = torch.randint(0, 10, (3, 5))
    try:
        call = rp.last_call
        assert (call.wall_ms, call.samples, call.tokens) == (0.0, 0, 0)
        rp.forward_backward((ids,), label=None, loss_fn=lambda out, _: out.sum())
        call = rp.last_call
        assert call.wall_ms > 0.0
        assert (call.samples, call.tokens) == (3, 15)
        with torch.no_grad():
            rp(torch.randint(0, 10, (2, 4)))
        assert rp.last_call is not call  # one record per call
        assert (rp.last_call.samples, rp.last_call.tokens) == (2, 8)
    finally:
        rp.close()


def test_forward_backward_hook_picks_the_default_and_wraps_the_result() -> None:
    """An integration changes a call's defaults through the hook, not by replacing the
    method: the caller's own choice of ``blocking`` reaches the hook as given."""
    torch.manual_seed(0)
    rp = RoundPipe(mlp(4), devices="cpu:2")
    seen = []

    def hook(call, kwargs):
        seen.append(kwargs["blocking"])
        if kwargs["blocking"] is None:
            return ("pending", call(**{**kwargs, "blocking": False}))
        return call(**kwargs)

    try:
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        plain = rp.forward_backward((x,), label=y, loss_fn=sum_sq)  # no hook: blocking
        assert isinstance(plain, torch.Tensor)
        rp.forward_backward_hook = hook
        tag, pending = rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert tag == "pending" and torch.equal(pending.result(), plain)
        assert isinstance(
            rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=True), torch.Tensor
        )
        assert seen == [None, True]
        rp.forward_backward_hook = None
        assert isinstance(rp.forward_backward((x,), label=y, loss_fn=sum_sq), torch.Tensor)
    finally:
        rp.close()


# -- parameter tensor hooks (Tensor.register_hook) ------------------------------------------
# What wandb.watch and gradient-logging callbacks do: a hook on a parameter of the wrapped
# model, or on a master (rp.optim_parameters()), registered after wrapping. Devices
# backpropagate into copies of the weights, so the engine runs the hooks itself on each
# call's whole gradient (every microbatch summed), once per backward, as plain PyTorch.
def _hooked_reference(model: nn.Module, batches, names: tuple[str, ...]):
    """Plain PyTorch: a logging hook and a doubling hook on ``names``, two backwards."""
    ref = copy.deepcopy(model)
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    params = dict(ref.named_parameters())
    for n in names:
        params[n].register_hook(lambda g, n=n: seen[n].append(g.clone()))
        params[n].register_hook(lambda g: g * 2)
    for x, y in batches:
        sum_sq(ref(x), y).backward()
    return seen, {n: p.grad.clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("where", ["model", "master", "shared"])
@pytest.mark.parametrize("mode", ["blocking", "non-blocking", "autograd"])
def test_tensor_hooks_registered_after_wrapping_are_honoured(mode: str, where: str) -> None:
    model = mlp(4)
    batches = [_data(seed=1), _data(seed=2)]
    names = ("0.weight", "3.bias")
    want_seen, want = _hooked_reference(model, batches, names)
    # "model" / "master": separate masters (shared_masters=False), a hook on the module's
    # parameter or on rp.optim_parameters(); "shared": the CPU default, where they are one
    shared = None if where == "shared" else False
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:2", shared_masters=shared)
    cfg = RoundPipeRunConfig(num_microbatch=2)
    targets = (
        dict(rp.optim_named_parameters())
        if where == "master"
        else dict(rp.model.named_parameters())
    )
    assert (targets["0.weight"] is rp.master_param(rp.model[0].weight)) == (where != "model")
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for n in names:
        targets[n].register_hook(lambda g, n=n: seen[n].append(g.clone()))
        targets[n].register_hook(lambda g: g * 2)
    try:
        for x, y in batches:
            if mode == "autograd":
                sum_sq(rp(x, roundpipe_run_config=cfg), y).backward()
            else:
                r = rp.forward_backward(
                    (x,), label=y, loss_fn=sum_sq, run_config=cfg, blocking=mode == "blocking"
                )
                if mode == "non-blocking":
                    r.result(timeout=60)
        assert {n: len(v) for n, v in seen.items()} == {n: 2 for n in names}  # once per backward
        for n in names:
            for got, ref in zip(seen[n], want_seen[n]):
                assert_close_rel(got, ref, what=f"{n}: the gradient the hook saw")
        assert_grads_match(rp, want)  # doubled where the hook doubles, as in PyTorch
    finally:
        rp.close()


def test_tensor_hooks_registered_before_wrapping_are_honoured_on_shared_masters() -> None:
    model = mlp(4)
    batches = [_data(seed=1)]
    want_seen, want = _hooked_reference(model, batches, ("1.0.weight",))
    net = copy.deepcopy(model)
    seen: list[torch.Tensor] = []
    net[1][0].weight.register_hook(lambda g: seen.append(g.clone()))
    net[1][0].weight.register_hook(lambda g: g * 2)
    rp = RoundPipe(net, devices="cpu:2")  # the CPU default: the parameter is its own master
    try:
        x, y = batches[0]
        rp.forward_backward(
            (x,), label=y, loss_fn=sum_sq, run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        assert len(seen) == 1
        assert_close_rel(seen[0], want_seen["1.0.weight"][0], what="hook's gradient")
        assert_grads_match(rp, want)
    finally:
        rp.close()


def test_tensor_hooks_run_before_register_grad_hook_sees_the_gradients() -> None:
    """The data-parallel reducer's path (a grad hook per completed master): it gets the
    gradients the tensor hooks returned, as DDP reduces what a parameter's hooks left."""
    model = mlp(4)
    x, y = _data()
    _, want = reference_grads(model, x, y)
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:2", shared_masters=False)
    rp.model[0].weight.register_hook(lambda g: g * 2)
    reported: dict[str, torch.Tensor] = {}
    names = {id(m): n for n, m in rp.optim_named_parameters()}
    rp.register_grad_hook(lambda ms: reported.update((names[id(m)], m.grad.clone()) for m in ms))
    try:
        rp.forward_backward(
            (x,), label=y, loss_fn=sum_sq, run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        assert set(reported) == set(want)
        assert_close_rel(reported["0.weight"], want["0.weight"] * 2, what="hooked")
        assert_close_rel(reported["0.bias"], want["0.bias"], what="not hooked")
    finally:
        rp.close()


def test_a_hook_returning_a_wrong_shape_is_an_error_naming_the_parameter() -> None:
    rp = RoundPipe(mlp(4), devices="cpu:2")
    rp.model[0].bias.register_hook(lambda g: g[:1])
    x, y = _data()
    try:
        with pytest.raises(RuntimeError, match=r"parameter '0\.bias' returned \(1,\)"):
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
    finally:
        rp.close()


@pytest.mark.parametrize("where", ["model", "master"])
def test_post_accumulate_hooks_after_wrapping_are_refused_at_the_next_call(where: str) -> None:
    """Such a hook gets the parameter to step it inside the backward: not honoured, so
    refused by name instead of silently never called."""
    rp = RoundPipe(mlp(4), devices="cpu:2", shared_masters=False)
    p = rp.model[3].weight if where == "model" else rp.master_param(rp.model[3].weight)
    assert p is not None
    handle = p.register_post_accumulate_grad_hook(lambda t: None)
    x, y = _data()
    try:
        with pytest.raises(ValueError, match=r"parameter '3\.weight' .*post_accumulate"):
            rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
        with pytest.raises(ValueError, match=r"'3\.weight'"):
            sum_sq(rp(x), y).backward()
        handle.remove()
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)  # accepted once removed
    finally:
        rp.close()


@pytest.mark.parametrize("overlap", ["two calls in flight", "step between"])
def test_grad_hooks_in_non_blocking_calls_see_each_master_once_per_call(overlap: str) -> None:
    """register_grad_hook in non-blocking calls (one gradient countdown for every call
    mode): the hook hears of each master once per call, and when it does, that call's
    gradient is in .grad -- summed in issue order, so the gradients a blocking loop
    leaves. With a step between the calls, the second call's gradients reach .grad (and
    the hook) only after that step read the first call's."""
    model = mlp(4)
    (x1, y1), (x2, y2) = _data(seed=1), _data(seed=2)
    rp = RoundPipe(copy.deepcopy(model), devices="cpu:2", shared_masters=False)
    names = {id(m): n for n, m in rp.optim_named_parameters()}
    heard: list[tuple[int, str, torch.Tensor]] = []
    calls = {"n": 0}
    rp.register_grad_hook(
        lambda ms: heard.extend((calls["n"], names[id(m)], m.grad.clone()) for m in ms)
    )
    cfg = RoundPipeRunConfig(num_microbatch=2)
    lr = 0.1
    opt = torch.optim.SGD(rp.optim_parameters(), lr=lr)
    try:
        calls["n"] = 1
        p1 = rp.forward_backward((x1,), label=y1, loss_fn=sum_sq, run_config=cfg, blocking=False)
        if overlap == "step between":
            p1.result(timeout=60)
            first = {n: g for c, n, g in heard if c == 1}
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        calls["n"] = 2
        p2 = rp.forward_backward((x2,), label=y2, loss_fn=sum_sq, run_config=cfg, blocking=False)
        p1.result(timeout=60)
        p2.result(timeout=60)
        rp.synchronize()
    finally:
        rp.close()
    if overlap == "two calls in flight":
        # hooks of call 2 are heard in merge order; .grad then holds g1 + g2
        _, g1 = reference_grads(model, x1, y1)
        _, g2 = reference_grads(model, x2, y2)
        for n in g1:
            reports = [g for _, name, g in heard if name == n]
            assert len(reports) == 2, f"{n}: heard {len(reports)} times for two calls"
            assert_close_rel(reports[-1], g1[n] + g2[n], what=f"{n} after both calls")
    else:
        _, g1 = reference_grads(model, x1, y1)
        # the second call computes with the weights before the step (one step stale)
        _, g2 = reference_grads(model, x2, y2)
        assert set(first) == set(g1)
        for n in g1:
            assert_close_rel(first[n], g1[n], what=f"{n} of call 1")
            second = [g for c, name, g in heard if c == 2 and name == n]
            assert len(second) == 1, f"{n}: heard {len(second)} times for call 2"
            assert_close_rel(second[0], g2[n], what=f"{n} of call 2 (after the step)")
