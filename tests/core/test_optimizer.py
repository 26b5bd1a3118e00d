"""Master copies, the optimizer thread, the async (one-step stale) update, low precision."""

from __future__ import annotations

import copy
import threading
import time

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


def _stale_reference(model, batches, lr):
    """The documented one-step-stale rule by hand: fb1 and fb2 at w0, fb3 at w1;
    w_k = w_(k-1) - lr * g_k. Returns (w0, w1, w2, w3)."""

    def grads_at(weights, x, y):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for p, w in zip(m.parameters(), weights):
                p.copy_(w)
        sum_sq(m(x), y).backward()
        return [p.grad for p in m.parameters()]

    w0 = [p.detach().clone() for p in model.parameters()]
    g1 = grads_at(w0, *batches[0])
    g2 = grads_at(w0, *batches[1])  # stale: fb2 ran before step1 reached the model
    w1 = [p - lr * g for p, g in zip(w0, g1)]
    w2 = [p - lr * g for p, g in zip(w1, g2)]
    g3 = grads_at(w1, *batches[2])  # step2 put w1 into the model ahead of its own update
    w3 = [p - lr * g for p, g in zip(w2, g3)]
    return w0, w1, w2, w3


@pytest.mark.parametrize("copy_held_back", [False, True])
def test_async_step_is_one_step_stale(copy_held_back):
    """fb1 at w0; step1 (async); fb2 still at w0; step2 copies w1 into the model on the
    optimizer thread, ahead of computing w2 = w1 - lr*g(w0); fb3 computes at w1.

    With the optimizer thread held busy when step2 is queued, step2's copy of w1 has not
    started when fb3 does: fb3's uploads must wait for it layer by layer (reading w0
    would give other gradients). Otherwise wait_step() shows w1 in the model."""
    lr = 0.05
    model = mlp()
    batches = _batches(3, seed=3)
    w0, w1, w2, w3 = _stale_reference(model, batches, lr)

    rp = RoundPipe(model, devices="cpu:2", shared_masters=False)
    try:
        opt = torch.optim.SGD(rp.optim_parameters(), lr=lr)

        rp.forward_backward((batches[0][0],), label=batches[0][1], loss_fn=sum_sq)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        rp.forward_backward((batches[1][0],), label=batches[1][1], loss_fn=sum_sq)
        # the model still holds w0 until the next step/synchronize
        for p, q in zip(model.parameters(), w0):
            assert torch.equal(p.detach(), q)
        if copy_held_back:  # the optimizer thread is busy until the timer fires
            release = threading.Event()
            rp._steps._submit(release.wait, 10.0)
            threading.Timer(0.5, release.set).start()
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        if copy_held_back:  # w1 cannot be in the model yet
            assert not rp._steps.pending().done()
            assert torch.equal(next(model.parameters()).detach(), w0[0])
        else:  # once step 2 is done the model holds w1 (copied ahead of it), the masters w2
            rp.wait_step()
            for p, w in zip(model.parameters(), w1):
                assert_close_rel(p.detach(), w, what="after wait_step the model holds w1")
            for p, w in zip(rp.optim_parameters(), w2):
                assert_close_rel(p.detach(), w, what="after wait_step the masters hold w2")
        rp.forward_backward((batches[2][0],), label=batches[2][1], loss_fn=sum_sq)
        for p, w in zip(model.parameters(), w1):
            assert_close_rel(
                p.detach(), w, what="after step 2 and the next call the model holds w1"
            )
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        rp.synchronize()
        for p, w in zip(model.parameters(), w3):
            assert_close_rel(p.detach(), w, what="after synchronize the model holds w3")
        rp.wait_step()
        for p, w in zip(rp.optim_parameters(), w3):
            assert_close_rel(p.detach(), w, what="the masters hold w3")
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
    rp = RoundPipe(mlp(), devices="cpu:2", shared_masters=False)
    try:
        x, y = _batches(1)[0]
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)

        def bad():
            raise ArithmeticError("optimizer exploded")

        rp.step(bad, is_async=True)  # async: surfaces at the next synchronisation point
        with pytest.raises(ArithmeticError, match="optimizer exploded"):
            rp.synchronize()
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
        rp.step(lambda: opt.step(), is_async=False)
        with pytest.raises(TypeError, match="callable"):
            rp.step(None, is_async=True)  # type: ignore[arg-type]
    finally:
        rp.close()


def test_a_failed_async_step_still_running_at_the_next_step_is_raised_once():
    """step2 is queued while step1 still runs, then step1 fails: step2 and its copy of
    step1's weights are skipped, the next call computes with the last completed weights
    (w0) without waiting forever, and the error is raised once, by the next step()."""
    model = mlp()
    w0 = copy.deepcopy(model)
    batches = _batches(3, seed=5)
    rp = RoundPipe(model, devices="cpu:2", shared_masters=False)
    try:
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)

        def slow_bad():
            time.sleep(0.5)
            raise ArithmeticError("optimizer exploded")

        rp.forward_backward((batches[0][0],), label=batches[0][1], loss_fn=sum_sq)
        rp.step(slow_bad, is_async=True)
        assert not rp._steps.pending().done(), "step1 must still run when step2 is queued"
        rp.step(
            lambda: (opt.step(), opt.zero_grad()), is_async=True
        )  # returns at once: step1 still runs
        x, y = batches[2]
        loss = rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert_close_rel(loss.detach(), sum_sq(w0(x), y).detach(), what="the next call reads w0")
        with pytest.raises(ArithmeticError, match="optimizer exploded"):
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        for p, q in zip(model.parameters(), w0.parameters()):
            assert torch.equal(p.detach(), q.detach()), "no step completed: the model holds w0"
        rp.synchronize()  # raised once: nothing more to report
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)  # and training goes on
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
