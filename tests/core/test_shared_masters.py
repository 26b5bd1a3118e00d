"""``RoundPipe(shared_masters=True)``: a parameter already in ``optim_dtype`` is its own
master. The weights exist once, training is the same computation as plain PyTorch,
steps are synchronous, and gradients of a call are not kept beyond their merge."""

from __future__ import annotations

import copy
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _util import assert_close_rel, mlp, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, OptimizerCtx, RoundPipe
from roundpipe_core.running.host_memory import estimate_host_memory
from roundpipe_core.stepping import pipelined as pipelined_mod

STEPS = 4


def _batches(n: int = STEPS, batch: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(n)
    ]


def _tied_frozen_mlp() -> nn.Sequential:
    """Six layers; layer 4's weight is layer 1's (tied across stages), layer 2 is frozen."""
    net = mlp(6)
    net[4][0].weight = net[1][0].weight
    for p in net[2].parameters():
        p.requires_grad_(False)
    return net


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _assert_shared(rp: RoundPipe) -> None:
    """Every master is the model's own trainable parameter: one tensor, not two."""
    trainable = [p for p in rp.model.parameters() if p.requires_grad]
    masters = rp.optim_parameters()
    assert len(masters) == len(trainable) and rp.masters.num_shared == len(trainable)
    for p, m in zip(trainable, masters):
        assert m is p and m.data_ptr() == p.data_ptr()
    assert rp.masters.copies == []


def _train_reference(net: nn.Module, batches: list, per_step: int = 1) -> list[dict]:
    """Plain PyTorch, the same loop: grads (before each step) and weights after each."""
    ref = copy.deepcopy(net)
    opt = _adamw([p for p in ref.parameters() if p.requires_grad])
    out = []
    for i in range(0, len(batches), per_step):
        for x, y in batches[i : i + per_step]:
            sum_sq(ref(x), y).backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(
            {"grads": grads, "weights": {n: p.detach().clone() for n, p in ref.named_parameters()}}
        )
    return out


def _check_against(rp: RoundPipe, ref: dict, grads: dict) -> None:
    assert set(grads) == set(ref["grads"])
    for n, g in grads.items():
        assert_close_rel(g, ref["grads"][n], 1e-5, f"grad {n}")


def _check_weights(rp: RoundPipe, ref: dict) -> None:
    for n, p in rp.model.named_parameters():
        assert_close_rel(p.detach(), ref["weights"][n], 1e-5, f"weight {n}")


def _grads_by_name(rp: RoundPipe) -> dict[str, torch.Tensor]:
    return {n: m.grad.clone() for n, m in rp.optim_named_parameters() if m.grad is not None}


@pytest.mark.parametrize("model", ["mlp", "tied_frozen"])
def test_shared_masters_are_the_parameters_and_train_like_pytorch(
    pool_devices: Callable[[int], Any], model: str
) -> None:
    net = mlp(6) if model == "mlp" else _tied_frozen_mlp()
    batches = _batches()
    refs = _train_reference(net, batches)
    rp = RoundPipe(net, shared_masters=True, devices=pool_devices(2))
    _assert_shared(rp)
    if model == "tied_frozen":
        assert rp.master_param(net[2][0].weight) is None  # frozen: no master
        assert rp.master_param(net[4][0].weight) is net[1][0].weight  # tied: one master
    with OptimizerCtx():
        opt = _adamw(rp.parameters())
    for (x, y), ref in zip(batches, refs):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
        # the masters' .grad is the parameters' own
        for p in rp.optim_parameters():
            assert p.grad is not None
        _check_against(rp, ref, _grads_by_name(rp))

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        rp.step(step, is_async=False)
        _check_weights(rp, ref)  # updated in place: no copy, no synchronize() needed
    _assert_shared(rp)
    rp.close()


class _Fp32Head(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.float())


def test_half_precision_parameters_keep_fp32_copies() -> None:
    """A bf16 model with fp32 masters shares nothing; in a mixed model only the
    parameters already in fp32 are shared."""
    net = mlp(4).to(torch.bfloat16)
    net[3] = _Fp32Head(net[3].float())  # an fp32 head (as norms kept in fp32 are)
    rp = RoundPipe(net, optim_dtype=torch.float32, shared_masters=True, devices="cpu:2")
    shared = {id(p) for p in net[3].parameters()}
    for _, p, m in rp.masters.entries:
        assert m.dtype == torch.float32
        assert (m is p) == (id(p) in shared)
    assert rp.masters.num_shared == 2 and len(rp.masters.copies) == len(rp.masters.entries) - 2
    with OptimizerCtx():
        opt = torch.optim.SGD(rp.parameters(), lr=0.1)
    x, y = (t.to(torch.bfloat16) for t in _batches(1)[0])
    before = [p.detach().float().clone() for p in net.parameters()]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: sum_sq(o.float(), t.float()))
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    # the bf16 weights received their masters' update, the fp32 head was updated in place
    for (_, p, m), b in zip(rp.masters.entries, before):
        assert torch.equal(p.detach().float(), m.detach().to(p.dtype).float())
        assert not torch.equal(p.detach().float(), b)
    rp.close()


def test_async_step_warns_once_and_runs_synchronously() -> None:
    net = mlp(6)
    batches = _batches()
    refs = _train_reference(net, batches)
    rp = RoundPipe(net, shared_masters=True, devices="cpu:2")
    with OptimizerCtx():
        opt = _adamw(rp.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for (x, y), ref in zip(batches, refs):
            rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
            _check_against(rp, ref, _grads_by_name(rp))
            rp.step(lambda: (opt.step(), opt.zero_grad(set_to_none=True)))  # is_async=True
            # the step already ran: nothing pending, the weights are this step's (not stale)
            assert rp._steps.pending() is None
            _check_weights(rp, ref)
    said = [w for w in caught if "shared_masters" in str(w.message)]
    assert len(said) == 1 and "is_async" in str(said[0].message)
    rp.close()


def test_without_sharing_async_step_stays_async() -> None:
    """The option off: copies, and no warning from step(is_async=True)."""
    net = mlp(4)
    rp = RoundPipe(net, devices="cpu:2", shared_masters=False)
    assert rp.masters.num_shared == 0
    assert all(m is not p for _, p, m in rp.masters.entries)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, y = _batches(1)[0]
        rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
        rp.step(lambda: None)
    rp.close()


@pytest.mark.parametrize("per_step", [1, 2])
def test_non_blocking_calls_match_pytorch_and_no_upload_meets_a_step(per_step: int) -> None:
    """forward_backward(blocking=False) with shared masters: the step waits for the
    runs issued before it; no run reads the weights while a step writes them."""
    net = mlp(6)
    batches = _batches(2 * per_step)
    refs = _train_reference(net, batches, per_step)
    rp = RoundPipe(net, shared_masters=True, devices="cpu:2")
    with OptimizerCtx():
        opt = _adamw(rp.parameters())
    readers_during_step: list[int] = []

    def step() -> None:
        readers_during_step.append(len(rp._steps.versions._readers))
        time.sleep(0.05)  # a later call issued too early would register its run meanwhile
        readers_during_step.append(len(rp._steps.versions._readers))
        opt.step()
        opt.zero_grad(set_to_none=True)

    seen: list[dict] = []
    for i in range(0, len(batches), per_step):
        pend = [
            rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq, blocking=False)
            for x, y in batches[i : i + per_step]
        ]
        pend[-1].result()
        seen.append(_grads_by_name(rp))
        rp.step(step)  # is_async=True runs synchronously (warns)
    rp.synchronize()
    assert readers_during_step and all(n == 0 for n in readers_during_step)
    for grads, ref in zip(seen, refs):
        _check_against(rp, ref, grads)
    _check_weights(rp, refs[-1])
    rp.close()


def test_non_blocking_step_deferred_behind_its_runs() -> None:
    """The step is issued while the runs are still in flight (no result() first)."""
    net = mlp(6)
    batches = _batches(4)
    refs = _train_reference(net, batches, 2)
    rp = RoundPipe(net, shared_masters=True, devices="cpu:2")
    with OptimizerCtx():
        opt = _adamw(rp.parameters())
    for i in (0, 2):
        for x, y in batches[i : i + 2]:
            rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq, blocking=False)
        rp.step(lambda: (opt.step(), opt.zero_grad(set_to_none=True)), is_async=False)
        _check_weights(rp, refs[i // 2])
    rp.close()


class _Boom(nn.Module):
    """Raises in forward once ``armed`` is set."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Boom.armed:
            raise RuntimeError("boom")
        return x


def test_a_failing_call_leaves_grad_untouched() -> None:
    net = nn.Sequential(*mlp(6), _Boom())
    rp = RoundPipe(net, shared_masters=True, devices="cpu:2")
    _assert_shared(rp)
    x, y = _batches(1)[0]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
    kept = {id(p): (p.grad, p.grad.clone()) for p in rp.optim_parameters()}
    _Boom.armed = True
    try:
        with pytest.raises(RuntimeError, match="boom"):
            rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
    finally:
        _Boom.armed = False
    for p in rp.optim_parameters():
        obj, value = kept[id(p)]
        assert p.grad is obj and torch.equal(p.grad, value)
    rp.close()


def test_synchronize_contract_holds_for_shared_masters() -> None:
    """synchronize() neither clears nor duplicates a shared master's .grad: accumulation
    continues, zero_grad() on the module clears it, a replaced .grad is what the masters use."""
    net = mlp(4)
    rp = RoundPipe(net, shared_masters=True, devices="cpu:2")
    x, y = _batches(1)[0]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
    once = [p.grad.clone() for p in net.parameters()]
    rp.synchronize()
    held = [p.grad for p in net.parameters()]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)  # accumulates
    for p, g, h in zip(net.parameters(), once, held):
        assert p.grad is h  # the same tensor, added into
        assert_close_rel(p.grad, 2 * g, 1e-6, "accumulated")
    rp.synchronize()
    net.zero_grad(set_to_none=True)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
    for p, g in zip(net.parameters(), once):
        assert_close_rel(p.grad, g, 1e-6, "after zero_grad")
    rp.synchronize()
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
    for p, g in zip(net.parameters(), once):
        assert_close_rel(p.grad, g, 1e-6, "after replacing .grad")
    rp.close()


def test_shared_masters_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="shared_masters must be True, False or None .*got 'yes'"):
        RoundPipe(mlp(3), shared_masters="yes", devices="cpu:2")  # type: ignore[arg-type]


def test_the_default_shares_on_cpu_workers_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """shared_masters=None: CPU workers share (one copy of the weights, a synchronous
    step with plain PyTorch's numbers), said once at INFO, never as a warning."""
    net = mlp(6)
    batches = _batches()
    refs = _train_reference(net, batches)
    rp = RoundPipe(net, devices="cpu:2")
    try:
        assert rp.shared_masters is True and rp.masters.num_shared == len(list(net.parameters()))
        with OptimizerCtx():
            opt = _adamw(rp.parameters())
        with warnings.catch_warnings(), caplog.at_level(logging.INFO, "roundpipe_core"):
            warnings.simplefilter("error")
            for (x, y), ref in zip(batches, refs):
                rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
                rp.step(lambda: (opt.step(), opt.zero_grad(set_to_none=True)))  # is_async=True
                assert rp._steps.pending() is None  # it already ran
                _check_weights(rp, ref)  # not one step stale
        said = [r for r in caplog.records if "synchronous on CPU workers" in r.getMessage()]
        assert len(said) == 1 and "shared_masters=False" in said[0].getMessage()
    finally:
        rp.close()


def test_the_default_keeps_separate_masters_where_devices_overlap(concurrent_planning) -> None:
    """A pool whose devices compute concurrently (GPUs; here CPU workers declared so)
    keeps separate masters by default, for the asynchronous step."""
    rp = RoundPipe(mlp(4), devices="cpu:2")
    try:
        assert rp.shared_masters is False and rp.masters.num_shared == 0
        x, y = _batches(1)[0]
        rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
        release = threading.Event()
        rp.step(lambda: release.wait(10.0))  # is_async=True: returns while it runs
        assert rp._steps.pending() is not None
        release.set()
        rp.synchronize()
    finally:
        rp.close()


# -- host-memory budget -------------------------------------------------------------------------
def test_budget_counts_shared_masters_once() -> None:
    net = mlp(6, width=32)
    n = sum(p.numel() for p in net.parameters())
    shared = RoundPipe(net, shared_masters=True, devices="cpu:2")
    b = estimate_host_memory(shared, optimizer="adamw", num_microbatch=3)
    assert b.weights == 4 * n and b.masters == 0 and b.gradients == 4 * n
    assert b.optimizer_state == 8 * n and b.already_allocated == 4 * n
    shared.close()
    copied = RoundPipe(mlp(6, width=32), devices="cpu:2", shared_masters=False)
    assert estimate_host_memory(copied, optimizer="adamw", num_microbatch=3).masters == 4 * n
    copied.close()
    # a plain module, before building anything
    plain = estimate_host_memory(mlp(6, width=32), optimizer="adamw", shared_masters=True)
    assert plain.masters == 0 and plain.total == 16 * n
    half = mlp(6, width=32).to(torch.bfloat16)
    hb = estimate_host_memory(half, optim_dtype=torch.float32, shared_masters=True)
    assert hb.masters == 4 * n  # a different dtype: still a copy
    with pytest.raises(TypeError, match="shared_masters must be True or False"):
        estimate_host_memory(mlp(3), shared_masters=1)  # type: ignore[arg-type]


# -- per-call gradient buffers ----------------------------------------------------------------
def _record_downloads(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to every gradient a run hands to its GradBuffer."""
    refs: list[weakref.ref] = []
    original = pipelined_mod.GradBuffer.add

    def add(self: Any, param: torch.Tensor, grad: torch.Tensor) -> None:
        refs.append(weakref.ref(grad))
        original(self, param, grad)

    monkeypatch.setattr(pipelined_mod.GradBuffer, "add", add)
    return refs


@pytest.mark.parametrize(
    "path", ["blocking", "grad_hook", "non_blocking", "autograd", "synchronized"]
)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_call_gradients_are_freed_once_merged(
    monkeypatch: pytest.MonkeyPatch, path: str, shared: bool
) -> None:
    """A call's downloaded gradients: the first per master becomes its .grad (no copy),
    the others are added and released; after the step's zero_grad none is left (also
    when synchronize() showed them on the module's parameters in between)."""
    refs = _record_downloads(monkeypatch)
    net = mlp(6)
    net[4][0].weight = net[1][0].weight  # two downloads for one master
    # three backward stages: a tied master gets gradients from two of them
    plan = ModelExecutePlan([range(0, 3), range(3, 4)], [range(4, 6), range(2, 4), range(0, 2)])
    rp = RoundPipe(net, shared_masters=shared, devices="cpu:2")
    rp.set_plan("fused", plan)
    if path == "grad_hook":
        rp.register_grad_hook(lambda masters: None)
    with OptimizerCtx():
        opt = torch.optim.SGD(rp.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    for _ in range(2):
        if path == "non_blocking":
            rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq, blocking=False).result()
        elif path == "autograd":
            sum_sq(rp(x), y).backward()
        else:
            rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq)
        grads = {id(m.grad) for m in rp.optim_parameters() if m.grad is not None}
        alive = [r() for r in refs if r() is not None]
        assert len(refs) > len(grads)  # the tied master received several
        assert all(id(t) in grads for t in alive), "a merged gradient is still referenced"
        assert len(alive) == len(grads)  # same dtype: each .grad is a downloaded tensor
        del alive
        if path == "synchronized":
            rp.synchronize()
        rp.step(lambda: (opt.step(), opt.zero_grad(set_to_none=True)), is_async=False)
        assert all(r() is None for r in refs), "gradients survive the step that consumed them"
        refs.clear()
    rp.close()
