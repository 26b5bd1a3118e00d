"""Master copies, the optimizer thread, the async (one-step stale) update, low precision."""

from __future__ import annotations

import copy

import pytest
import torch
from _util import assert_close_rel, mlp, sum_sq

from roundpipe_core import OptimizerCtx, RoundPipe, RoundPipeRunConfig


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def test_adamw_fused_on_masters_matches_plain_training():
    model = mlp()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    rp = RoundPipe(model, devices="cpu:2", optim_dtype=torch.float32)
    try:
        with OptimizerCtx():
            params = list(rp.parameters())
        assert all(p.dtype == torch.float32 for p in params)
        assert {id(p) for p in params} == {id(p) for p in rp.optim_parameters()}
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        for x, y in _batches(4):
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            sum_sq(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert_close_rel(p.detach(), q.detach(), 1e-5, n)
        assert model.state_dict().keys() == ref.state_dict().keys()
    finally:
        rp.close()


def test_async_step_is_one_step_stale():
    """fb1 at w0; step1 (async); fb2 still at w0; step2 applies w1 and computes w2 = w1 - lr*g(w0)."""
    lr = 0.05
    model = mlp()
    batches = _batches(3, seed=3)
    # reference of the documented semantics
    ref = copy.deepcopy(model)
    w0 = copy.deepcopy(ref)

    def grads_at(m, x, y):
        m = copy.deepcopy(m)
        sum_sq(m(x), y).backward()
        return [p.grad for p in m.parameters()]

    g1 = grads_at(w0, *batches[0])
    g2 = grads_at(w0, *batches[1])  # stale: fb2 ran before step1 reached the model
    w1 = [p.detach() - lr * g for p, g in zip(w0.parameters(), g1)]
    w2 = [p - lr * g for p, g in zip(w1, g2)]

    rp = RoundPipe(model, devices="cpu:2")
    try:
        opt = torch.optim.SGD(rp.optim_parameters(), lr=lr)
        rp.forward_backward((batches[0][0],), label=batches[0][1], loss_fn=sum_sq)
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        rp.forward_backward((batches[1][0],), label=batches[1][1], loss_fn=sum_sq)
        # the model still holds w0 until the next step/synchronize
        for p, q in zip(model.parameters(), w0.parameters()):
            assert torch.equal(p.detach(), q.detach())
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        for p, w in zip(model.parameters(), w1):
            assert_close_rel(p.detach(), w, what="after step 2 is launched the model holds w1")
        rp.synchronize()
        for p, w in zip(model.parameters(), w2):
            assert_close_rel(p.detach(), w, what="after synchronize the model holds w2")
    finally:
        rp.close()


def test_bf16_model_with_fp32_masters():
    model = mlp().to(torch.bfloat16)
    rp = RoundPipe(model, devices="cpu:2", optim_dtype=torch.float32)
    try:
        assert all(p.dtype == torch.float32 for p in rp.optim_parameters())
        opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3, fused=True)
        for x, y in _batches(2):
            loss = rp.forward_backward(
                (x.bfloat16(),),
                label=y.bfloat16(),
                loss_fn=lambda o, t: sum_sq(o.float(), t.float()),
            )
            assert torch.isfinite(loss)
            assert all(
                p.grad is not None and p.grad.dtype == torch.float32 for p in rp.optim_parameters()
            )
            rp.step(lambda: (opt.step(), opt.zero_grad()))
        rp.synchronize()
        for (_, p), m in zip(model.named_parameters(), rp.optim_parameters()):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    finally:
        rp.close()


def test_step_errors_reach_the_caller_and_next_step_works():
    rp = RoundPipe(mlp(), devices="cpu:2")
    try:
        x, y = _batches(1)[0]
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)

        def bad():
            raise ArithmeticError("optimizer exploded")

        rp.step(bad)  # async: surfaces at the next synchronisation point
        with pytest.raises(ArithmeticError, match="optimizer exploded"):
            rp.synchronize()
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
        rp.step(lambda: opt.step(), is_async=False)
        with pytest.raises(TypeError, match="callable"):
            rp.step(None)  # type: ignore[arg-type]
    finally:
        rp.close()


def test_attribute_access_falls_through_to_the_wrapped_model():
    model = mlp()
    model.config = {"hidden": 12}
    rp = RoundPipe(model, devices="cpu:1", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    try:
        assert rp.config == {"hidden": 12}
        assert rp.num_layers == 6 and rp.num_devices == 1
        assert rp.layers[0] is model[0]
        with pytest.raises(AttributeError):
            _ = rp.no_such_attribute
    finally:
        rp.close()
