"""CPU workers compute on the host's parameters when nothing writes them during a call.

Device memory of a CPU worker is host memory: an upload that clones every parameter
costs a copy of the model per iteration. Where no step can write the host weights
while the call runs (no weight-version gate: steps are synchronous, or their copy into
the model is done), the stage computes on aliases of the host parameters; buffers are
still copied (a forward may write them, and its recompute must not write them twice).
Where a gate is given (overlapped calls; a call issued while an asynchronous step's
weights are still being copied in) they lend too: the upload waits for the version it
reads, and the copy of a newer version waits until the stage computing on the host
weights is released.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from _util import assert_grads_match, mlp, reference_grads, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.running.devices.cpu import CPUWorker

# what is tested is the CPU backend's own lending: under ROUNDPIPE_TEST_DEVICE the
# workers stay CPU workers (CUDA workers always copy)
pytestmark = pytest.mark.cpu_backend

#: the weight storage each forward of a _Recorder computed with (a module global, not
#: layer state: the forward rules allow a layer to write only its own buffers)
SEEN: list[int] = []
#: an Event the _Recorder's forward waits for, when set (a module global too)
HOLD: list[threading.Event | None] = [None]


class _Recorder(nn.Module):
    """A Linear that records the storage its weight had in each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(self.lin.weight.data_ptr())
        hold = HOLD[0]
        if hold is not None:
            hold.wait(10.0)
        return self.lin(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Recorder(), nn.Tanh(), nn.Linear(8, 4))


TWO_STAGES = ModelExecutePlan.uniform(3, 2)  # fwd 0-1, bwd: fused 2, then 0-1 recomputed


@pytest.mark.parametrize("plan", [None, TWO_STAGES], ids=["default", "two-stages"])
def test_a_blocking_call_computes_on_the_host_parameters(plan) -> None:
    model = _model()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    _, ref = reference_grads(model, x, y)
    SEEN.clear()
    host_ptr = model[0].lin.weight.data_ptr()
    rp = RoundPipe(
        model,
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    try:
        cfg = RoundPipeRunConfig(execute_plan=plan)  # a fused plan: the call's own
        rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
        assert SEEN and all(p == host_ptr for p in SEEN), "an upload copied the weights"
        assert_grads_match(rp, ref)
        # the device-memory model still counts the stage's weights on its worker
        assert sum(w.ledger.peak.get("param", 0) for w in rp.pool.workers) > 0
        SEEN.clear()
        with torch.no_grad():
            rp(x)
        assert SEEN and all(p == host_ptr for p in SEEN)
    finally:
        rp.close()


def test_buffers_are_still_copied_and_written_back_once() -> None:
    """BatchNorm's running statistics: the forward writes them to its copy, written back
    once; the backward's recompute writes a throwaway copy. Same as plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(
        model,
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=1),
    )
    try:
        rp.forward_backward(
            (x,), label=y, loss_fn=sum_sq, run_config=RoundPipeRunConfig(execute_plan=TWO_STAGES)
        )
        sum_sq(ref(x), y).backward()
        assert torch.allclose(model[1].running_mean, ref[1].running_mean, atol=1e-7)
        assert torch.allclose(model[1].running_var, ref[1].running_var, atol=1e-7)
        assert int(model[1].num_batches_tracked) == 1
    finally:
        rp.close()


def _async_sequence(hold: threading.Event | None) -> tuple[list[torch.Tensor], bool, bool]:
    """Overlapped calls with asynchronous steps; with ``hold``, the third call's forward
    waits for it while the step after it queues the publication of a newer version.
    Returns the final weights, whether that call computed on the host weights, and
    whether the host weights stayed as they were while its stage was held."""
    model = _model()
    weight = model[0].lin.weight
    gen = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(3)
    ]
    rp = RoundPipe(
        model,
        devices="cpu:2",
        shared_masters=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    lent = unchanged = False
    try:
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)

        def step() -> None:
            opt.step()
            opt.zero_grad()

        (x, y), rest = batches[0], batches[1:]
        # the first training call measures activations with a host forward: not an upload
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.step(step, is_async=True)
        rp.forward_backward(
            (rest[0][0],), label=rest[0][1], loss_fn=sum_sq, blocking=False
        ).result()
        rp.step(step, is_async=True)
        SEEN.clear()
        HOLD[0] = hold
        before = weight.detach().clone()
        pending = rp.forward_backward(
            (rest[1][0],), label=rest[1][1], loss_fn=sum_sq, blocking=False
        )
        rp.step(step, is_async=True)  # queues the copy of the previous step's weights
        if hold is not None:
            time.sleep(0.3)  # time for that copy to overwrite the weights under the stage
            unchanged = torch.equal(weight.detach(), before)
            hold.set()
        pending.result()
        lent = bool(SEEN) and all(p == weight.data_ptr() for p in SEEN)
        rp.synchronize()
        return [p.detach().clone() for p in model.parameters()], lent, unchanged
    finally:
        HOLD[0] = None
        rp.close()


def test_overlapped_calls_lend_and_a_newer_version_waits_for_the_release(monkeypatch) -> None:
    """An overlapped call (one step stale) computes on the host weights too; the copy of
    a newer step's weights into them waits until the stage computing on them is
    released, so the call computes with the weights it reads: the same training as
    workers that copy."""
    got, lent, unchanged = _async_sequence(threading.Event())
    assert lent, "the overlapped call copied the weights"
    assert unchanged, "a newer version was copied into the weights a running stage computes on"
    from roundpipe_core.running.devices.base import Worker

    monkeypatch.setattr(CPUWorker, "lend_in", Worker.lend_in)  # a backend that copies
    ref, lent_ref, _ = _async_sequence(None)
    assert not lent_ref
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_a_call_behind_a_pending_publication_lends_after_waiting() -> None:
    """A blocking call issued while an asynchronous step's weights are still being copied
    into the model waits for its layers' copy, then computes on them (no newer copy can
    come before it returns: the next one is queued by a later step)."""
    model = _model()
    host_ptr = model[0].lin.weight.data_ptr()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(
        model,
        devices="cpu:2",
        shared_masters=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    try:
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        rp.synchronize()
        masters = [m.detach().clone() for m in rp.optim_parameters()]
        # an asynchronous step whose copy into the model is held back
        release = threading.Event()
        rp._steps._submit(release.wait, 10.0)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        threading.Timer(0.3, release.set).start()
        SEEN.clear()
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert SEEN and all(p == host_ptr for p in SEEN), "a gated call copied the weights"
        assert torch.equal(model[0].lin.weight.detach(), masters[0])  # it waited for the copy
        rp.synchronize()
    finally:
        rp.close()


def test_lent_parameters_give_plain_pytorch_training() -> None:
    """Several synchronous steps with lent weights: the same weights as plain PyTorch."""
    model = mlp()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=3))
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            x, y = torch.randn(9, 8, generator=gen), torch.randn(9, 4, generator=gen)
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
            rp.step(lambda: (opt.step(), opt.zero_grad()))
            sum_sq(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        rp.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
    finally:
        rp.close()
