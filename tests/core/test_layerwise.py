"""``step_layerwise``: the optimizer steps each parameter as soon as its gradients are
complete, while the backward still runs on the first layers -- with the result of one
``step()``, which is that of the blocking loop (one step stale)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from _util import assert_close_rel, mlp, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.stepping.layerwise import step_subset, steps_elementwise

STEPS = 5


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


MAKERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True),
}


def _train(
    make: Any, mode: str, blocking: bool, accumulate: int = 1, devices: int = 3
) -> tuple[list[torch.Tensor], list[int]]:
    """``mode``: "step" (one call) or "layerwise"; returns the weights and the sizes of
    the parts the layer-wise steps took. A layer-wise run slows its first layer's backward
    (its numbers unchanged) so that each step after the first finds deep layers complete
    while the backward still runs, however loaded the machine."""
    model = mlp()
    if mode == "layerwise" and not blocking:
        model[0] = _SlowFirst(model[0], delay=0.02)
    plan = ModelExecutePlan.uniform(len(model), 3, "fused")
    rp = RoundPipe(
        model,
        devices=f"cpu:{devices}",
        model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan),
        shared_masters=False,  # the asynchronous step this file is about
    )
    opt = make(rp.optim_parameters())
    parts: list[int] = []

    def some(ms: list[nn.Parameter]) -> None:
        parts.append(len(ms))
        step_subset(opt, ms)

    try:
        pending = []
        for k, (x, y) in enumerate(_batches(STEPS * accumulate)):
            pending.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=blocking))
            if (k + 1) % accumulate:
                continue
            if mode == "step":
                rp.step(lambda: (opt.step(), opt.zero_grad()))
            else:
                rp.step_layerwise(some, finish=opt.zero_grad)
        for r in pending:
            if not blocking:
                r.result()
        rp.synchronize()
        return [p.detach().clone() for p in model.parameters()], parts
    finally:
        rp.close()


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_layerwise_equals_one_step(name: str, accumulate: int) -> None:
    ref, _ = _train(MAKERS[name], "step", blocking=False, accumulate=accumulate)
    blocking_ref, _ = _train(MAKERS[name], "step", blocking=True, accumulate=accumulate)
    got, parts = _train(MAKERS[name], "layerwise", blocking=False, accumulate=accumulate)
    for a, b, c in zip(got, ref, blocking_ref):
        assert_close_rel(a, b, 1e-6, "layerwise vs one step")
        assert_close_rel(a, c, 1e-6, "layerwise vs the blocking loop")
    n_masters = len(list(mlp().parameters()))
    # every master once per step (the first step has nothing in flight: one part)
    assert sum(parts) == STEPS * n_masters
    assert len(parts) > STEPS, f"never stepped in parts: {parts}"
    # and it trained
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(got, mlp().parameters()))


def test_layerwise_after_blocking_calls_is_one_part() -> None:
    got, parts = _train(MAKERS["sgd-momentum"], "layerwise", blocking=True)
    ref, _ = _train(MAKERS["sgd-momentum"], "step", blocking=True)
    for a, b in zip(got, ref):
        assert_close_rel(a, b, 1e-6)
    assert parts == [len(list(mlp().parameters()))] * STEPS


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, delay: float) -> torch.Tensor:
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.delay)
        return g, None


class _SlowFirst(nn.Module):
    """The first layer: its backward is slow, so the deep layers' gradients are complete
    long before the iteration ends."""

    def __init__(self, lin: nn.Module | None = None, delay: float = 0.05) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 12) if lin is None else lin
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(self.lin(x), self.delay)


def test_deep_layers_step_while_the_backward_still_runs() -> None:
    model = mlp()
    model[0] = _SlowFirst()
    plan = ModelExecutePlan.uniform(len(model), 3, "fused")
    rp = RoundPipe(
        model,
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
    )
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
    first_layer = {id(m) for m in rp.masters.of_layers([model[0]])}
    seen: list[tuple[int, bool]] = []
    pending: list[Any] = []

    def some(ms: list[nn.Parameter]) -> None:
        first = any(id(m) in first_layer for m in ms)
        seen.append((len(ms), first or pending[-1].done()))
        step_subset(opt, ms)

    try:
        for x, y in _batches(3):
            pending.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False))
            rp.step_layerwise(some, finish=opt.zero_grad)
            rp.wait_step()
        rp.synchronize()
    finally:
        rp.close()
    # each step had a part of deep layers stepped while its iteration was not done
    assert [done for _, done in seen].count(False) >= 3, seen


def test_a_result_merging_meanwhile_is_not_stepped_around() -> None:
    """``result()`` on the caller merges the run while the layer-wise step of its window
    runs on the optimizer thread. A merge takes the gradients out of the run's buffer and
    then adds them to ``.grad``: the step must not take that moment for "nothing left to
    add" and step without them. Here the caller's merge always takes first and adds
    0.3 s later (the step's own take waits for it); unguarded, the step missed the
    gradients every time."""

    def train(layerwise: bool) -> list[torch.Tensor]:
        model = mlp()
        plan = ModelExecutePlan.uniform(len(model), 3, "fused")
        rp = RoundPipe(
            model,
            devices="cpu:2",
            model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
            shared_masters=False,
        )
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
        try:
            for x, y in _batches(2):
                if not layerwise:
                    rp.forward_backward((x,), label=y, loss_fn=sum_sq)
                    rp.step(lambda: (opt.step(), opt.zero_grad()))
                    continue
                r = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
                r.wait()  # done, not merged: the step finds every gradient complete
                took = threading.Event()
                take = r.buffer.take

                def slow_take(masters: Any = None, take: Any = take, took: Any = took) -> Any:
                    if masters is None:  # the caller's merge: takes, adds 0.3 s later
                        items = take()
                        took.set()
                        time.sleep(0.3)
                        return items
                    took.wait(1.0)  # the step's part comes after the caller's take
                    return take(masters)

                r.buffer.take = slow_take
                rp.step_layerwise(lambda ms: step_subset(opt, ms), finish=opt.zero_grad)
                r.result()
            rp.synchronize()
            return [p.detach().clone() for p in model.parameters()]
        finally:
            rp.close()

    for got, want in zip(train(layerwise=True), train(layerwise=False)):
        assert_close_rel(got, want, 1e-6, "layer-wise step vs the blocking loop")


def test_which_optimizers_step_in_parts() -> None:
    ps = [nn.Parameter(torch.zeros(2))]
    assert steps_elementwise(torch.optim.AdamW(ps, fused=True))
    assert steps_elementwise(torch.optim.SGD(ps, lr=0.1))
    assert not steps_elementwise(torch.optim.LBFGS(ps))

    class Coupled(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # e.g. a global-norm clip first
            return super().step(closure)

    assert not steps_elementwise(Coupled(ps, lr=0.1))

    class Declared(Coupled):
        roundpipe_elementwise = True

    assert steps_elementwise(Declared(ps, lr=0.1))
    hooked = torch.optim.Adam(ps)
    hooked.register_step_pre_hook(lambda *a: None)
    assert not steps_elementwise(hooked)


def test_step_subset_leaves_the_others_alone() -> None:
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(3)) for _ in range(4)]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn(3)
        q.grad = p.grad.clone()
    opt_a = torch.optim.Adam([{"params": a[:2]}, {"params": a[2:], "lr": 0.1}])
    opt_b = torch.optim.Adam([{"params": b[:2]}, {"params": b[2:], "lr": 0.1}])
    before = [p.detach().clone() for p in a]
    step_subset(opt_a, [a[0], a[3]])
    assert torch.equal(a[1], before[1]) and torch.equal(a[2], before[2])
    assert [len(g["params"]) for g in opt_a.param_groups] == [2, 2]
    step_subset(opt_a, [a[1], a[2]])
    opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_a_failing_part_is_raised_once_and_training_goes_on() -> None:
    model = mlp()
    rp = RoundPipe(
        model,
        devices="cpu:2",
        shared_masters=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
    fail = threading.Event()
    fail.set()

    def some(ms: list[nn.Parameter]) -> None:
        if fail.is_set():
            fail.clear()
            raise RuntimeError("boom in a part")
        step_subset(opt, ms)

    try:
        (x, y), (x2, y2) = _batches(2)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
        rp.step_layerwise(some, finish=opt.zero_grad, is_async=True)
        with pytest.raises(RuntimeError, match="boom in a part"):
            rp.forward_backward((x2,), label=y2, loss_fn=sum_sq, blocking=False).result()
        # the error was raised once; the next calls work
        r = rp.forward_backward((x2,), label=y2, loss_fn=sum_sq, blocking=False)
        rp.step_layerwise(some, finish=opt.zero_grad, is_async=True)
        assert torch.isfinite(r.result())
        rp.synchronize()
    finally:
        rp.close()


def test_bad_arguments_are_type_errors() -> None:
    rp = RoundPipe(mlp(), devices="cpu:1")
    try:
        with pytest.raises(TypeError, match="step_params must be callable"):
            rp.step_layerwise(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="finish must be callable"):
            rp.step_layerwise(lambda ms: None, finish=3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="is_async"):
            rp.step_layerwise(lambda ms: None, is_async="yes")  # type: ignore[arg-type]
    finally:
        rp.close()


def test_shared_masters_make_the_layerwise_step_synchronous() -> None:
    """With shared masters a step writes the weights the devices read: step_layerwise
    then runs synchronously (warned), with plain PyTorch's numbers."""

    def train(mode: str) -> list[torch.Tensor]:
        model = mlp()
        rp = RoundPipe(
            model,
            devices="cpu:2",
            model_run_config=RoundPipeRunConfig(num_microbatch=3),
            shared_masters=mode == "layerwise",
        )
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05, momentum=0.9)
        try:
            for x, y in _batches(STEPS):
                if mode == "layerwise":
                    r = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
                    rp.step_layerwise(
                        lambda ms: step_subset(opt, ms), finish=opt.zero_grad, is_async=True
                    )
                    assert r.done()  # synchronous: the step waited for the call
                else:
                    rp.forward_backward((x,), label=y, loss_fn=sum_sq)
                    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            rp.synchronize()
            return [p.detach().clone() for p in model.parameters()]
        finally:
            rp.close()

    with pytest.warns(UserWarning, match="shared_masters=True"):
        got = train("layerwise")
    for a, b in zip(got, train("sync")):
        assert_close_rel(a, b, 1e-6)
