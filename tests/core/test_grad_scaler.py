"""roundpipe_core.amp.GradScaler: torch.amp.GradScaler's numbers, across RoundPipe's threads.

A run with injected inf gradients must give the same sequence of scales, skipped
steps and parameters as torch.amp.GradScaler -- called in order on one thread, with
the step on another thread and update() before it (the published RoundPipe pattern),
and inside RoundPipe with an asynchronous step.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _util import mlp

from roundpipe_core import RoundPipe
from roundpipe_core.amp import GradScaler

INF_AT = {1, 2, 6}  # iterations whose gradients overflow
KW = {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}


def _loss(model: torch.nn.Module, x: torch.Tensor, it: int) -> torch.Tensor:
    loss = (model(x) ** 2).mean()
    return loss * float("inf") if it in INF_AT else loss


def _reference(make_opt, iters: int = 9):
    """Plain torch: the scales, skips and parameters of torch.amp.GradScaler."""
    model = mlp()
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler("cpu", **KW)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    scales, skipped = [], []
    for it in range(iters):
        scales.append(scaler.get_scale())
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(_loss(model, x, it)).backward()
        scaler.step(opt)
        opt.zero_grad()
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return scales, skipped, [p.detach() for p in model.parameters()], scaler.state_dict()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),  # unscales in-kernel
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_same_sequence_as_torch_in_program_order(opt_name):
    make_opt = OPTIMIZERS[opt_name]
    ref_scales, ref_skipped, ref_params, ref_state = _reference(make_opt)
    assert any(ref_skipped) and not all(ref_skipped)
    assert len(set(ref_scales)) > 2  # it backed off and grew

    model = mlp()
    opt = make_opt(model.parameters())
    scaler = GradScaler(**KW)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    scales, skipped = [], []
    for it in range(len(ref_scales)):
        scales.append(scaler.get_scale())
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(_loss(model, x, it)).backward()
        scaler.step(opt)
        opt.zero_grad()
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    assert scales == ref_scales and skipped == ref_skipped
    for a, b in zip(model.parameters(), ref_params):
        assert torch.equal(a.detach(), b)
    assert scaler.state_dict() == ref_state


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_step_on_another_thread_with_update_before_it(opt_name):
    """The published pattern: the training thread calls update() right after handing
    the step to the optimizer thread; the next iteration's scale() runs on a worker."""
    ref_scales, _, ref_params, _ = _reference(OPTIMIZERS[opt_name])
    model = mlp()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = GradScaler(**KW)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    rng = random.Random(0)
    optim_thread = ThreadPoolExecutor(1)
    worker = ThreadPoolExecutor(1)
    pending = None
    scales = []
    try:
        for it in range(len(ref_scales)):
            # the scale is taken on a worker thread while the previous step may still run
            # (update() was deferred), then the gradients go in once that step is done
            s = worker.submit(scaler.scale, torch.ones(())).result(timeout=30)
            if pending is not None:
                pending.result(timeout=30)
            scales.append(float(s))
            (_loss(model, x, it) * s).backward()

            delay = rng.uniform(0, 0.02)

            def step_fn(delay=delay):
                time.sleep(delay)  # the optimizer thread starts late, at random
                scaler.step(opt)
                opt.zero_grad()

            pending = optim_thread.submit(step_fn)
            scaler.update()  # before the step has run: deferred, never blocks
        pending.result(timeout=30)
    finally:
        optim_thread.shutdown()
        worker.shutdown()
    assert scales == ref_scales
    for a, b in zip(model.parameters(), ref_params):
        assert torch.equal(a.detach(), b)


def test_scale_waits_for_deferred_update_and_times_out_without_step():
    scaler = GradScaler(init_scale=4.0, wait_timeout=0.3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.update()  # no step yet: deferred
    got = []
    t = threading.Thread(target=lambda: got.append(scaler.scale(torch.tensor(1.0))))
    t.start()
    time.sleep(0.05)
    assert not got  # waiting for the step
    scaler.step(opt)
    t.join(timeout=10)
    assert got and got[0].item() == 4.0 * 1.0 and scaler.get_scale() == 4.0  # 1 clean step
    scaler.update()  # again without a step
    with pytest.raises(RuntimeError, match="no step came"):
        scaler.scale(torch.tensor(1.0))


def test_concurrent_scale_calls_see_one_scale_per_iteration():
    """Many worker threads scale losses while the optimizer thread steps and updates:
    every scaled loss of an iteration uses that iteration's scale (no torn reads)."""
    scaler = GradScaler(init_scale=8.0, growth_interval=1)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    seen: list[set[float]] = []
    with ThreadPoolExecutor(4) as workers, ThreadPoolExecutor(1) as optim_thread:
        for _ in range(6):
            outs = list(workers.map(lambda _: float(scaler.scale(torch.tensor(1.0))), range(32)))
            seen.append(set(outs))
            p.grad = torch.ones(3) * outs[0]
            fut = optim_thread.submit(scaler.step, opt)
            scaler.update()
            fut.result(timeout=30)
    assert all(len(s) == 1 for s in seen)
    assert [s.pop() for s in seen] == [8.0 * 2**i for i in range(6)]


def test_state_dict_interoperates_with_torch_and_disabled_is_a_passthrough():
    ours = GradScaler(init_scale=32.0, growth_interval=7)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == 32.0 and theirs.get_growth_interval() == 7
    back = GradScaler()
    back.load_state_dict(theirs.state_dict())
    assert back.get_scale() == 32.0
    off = GradScaler(enabled=False)
    t = torch.ones(2)
    assert off.scale(t) is t and off.get_scale() == 1.0
    p = torch.nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    off.step(torch.optim.SGD([p], lr=1.0))
    off.update()
    assert p.item() == 0.0
    multi = GradScaler(init_scale=2.0).scale([torch.ones(1), (torch.ones(2),)])
    assert isinstance(multi, list) and float(multi[1][0][0]) == 2.0
    with pytest.raises(ValueError, match="wait_timeout"):
        GradScaler(wait_timeout=0)


def test_roundpipe_async_step_gives_torch_scale_sequence():
    """Inside RoundPipe, the loss scaled on device workers, the step on the optimizer
    thread with is_async=True: the scales and skips are torch's (the injected overflows
    decide them), and the weights train."""
    ref_scales, ref_skipped, _, _ = _reference(OPTIMIZERS["sgd"])
    model = mlp()
    start = copy.deepcopy(model)
    rp = RoundPipe(model, devices=2)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler(**KW)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    scales, skipped = [], []
    try:
        for it in range(len(ref_scales)):
            scales.append(scaler.get_scale())
            loss_fn = (
                (lambda out, _y: scaler.scale((out**2).mean() * float("inf")))
                if it in INF_AT
                else (lambda out, _y: scaler.scale((out**2).mean()))
            )
            rp.forward_backward(input_args=(x,), label=None, loss_fn=loss_fn)
            before = [p.detach().clone() for p in rp.optim_parameters()]
            done = threading.Event()
            rp.step(lambda d=done: (scaler.step(opt), opt.zero_grad(), d.set()), is_async=True)
            scaler.update()
            assert done.wait(30)
            skipped.append(all(torch.equal(b, p) for b, p in zip(before, rp.optim_parameters())))
        rp.synchronize()
    finally:
        rp.close()
    assert scales == ref_scales and skipped == ref_skipped
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters()))


def test_update_is_async_false_waits_for_the_optimizer_threads_update():
    """``update(is_async=False)`` (the published package's 0.1.2 argument) returns only
    once the update deferred to the optimizer thread's step is done; the default returns
    at once. A step that never comes is an error after ``wait_timeout``, not a hang."""
    rp = RoundPipe(mlp(4), devices="cpu:2", shared_masters=False)  # an asynchronous step
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
    scaler = GradScaler(init_scale=8.0, growth_interval=1, wait_timeout=30)
    x = torch.randn(6, 8)
    stepped: list[bool] = []

    def step_fn() -> None:
        time.sleep(0.3)  # the optimizer thread is busy: update() finds no step yet
        stepped.append(True)  # (before scaler.step, whose update wakes the waiting caller)
        scaler.step(opt)
        opt.zero_grad()

    try:
        for is_async in (True, False):
            stepped.clear()
            rp.forward_backward((x,), loss_fn=lambda out, _y: scaler.scale((out**2).mean()))
            rp.step(step_fn, is_async=True)
            scaler.update(is_async=is_async)
            assert stepped == ([] if is_async else [True])  # waited for step and update
            assert scaler._pending is is_async
            rp.wait_step()
        assert scaler.get_scale() == 32.0  # two clean iterations grew it twice
        with pytest.raises(TypeError, match="is_async"):
            scaler.update(is_async="no")  # type: ignore[arg-type]
    finally:
        rp.close()
    lone = GradScaler(init_scale=4.0, wait_timeout=0.2)
    p = torch.nn.Parameter(torch.ones(2))
    lone.scale(p.sum()).backward()
    lone.step(torch.optim.SGD([p], lr=0.1))
    lone.update()
    lone.scale(p.sum()).backward()
    with pytest.raises(RuntimeError, match=r"update\(is_async=False\) waited 0.2s"):
        lone.update(is_async=False)  # this iteration's scaler.step() never comes
