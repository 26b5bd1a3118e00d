"""CPU workers compute on the host's parameters when nothing writes them during a call.

Device memory of a CPU worker is host memory: an upload that clones every parameter
costs a copy of the model per iteration. Where no step can write the host weights
while the call runs (no weight-version gate: steps are synchronous, or their copy into
the model is done), the stage computes on aliases of the host parameters; buffers are
still copied (a forward may write them, and its recompute must not write them twice).
Where a gate is given (pipelined calls; a call issued while an asynchronous step's
weights are still being copied in), uploads copy as before.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from _util import assert_grads_match, mlp, reference_grads, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

# what is tested is the CPU backend's own lending: under ROUNDPIPE_TEST_DEVICE the
# workers stay CPU workers (CUDA workers always copy)
pytestmark = pytest.mark.cpu_backend

#: the weight storage each forward of a _Recorder computed with (a module global, not
#: layer state: the forward rules allow a layer to write only its own buffers)
SEEN: list[int] = []


class _Recorder(nn.Module):
    """A Linear that records the storage its weight had in each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(self.lin.weight.data_ptr())
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


def test_pipelined_calls_and_a_pending_publication_copy() -> None:
    """Where a step may write the host weights during the call, the stage gets copies."""
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
        # the first training call measures activations with a host forward: not an upload
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.synchronize()
        SEEN.clear()
        rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False).result()
        assert SEEN and host_ptr not in SEEN, "a pipelined call computed on the host weights"
        rp.synchronize()
        # an asynchronous step whose copy into the model is held back: the next blocking
        # call's uploads wait for it and then copy
        release = threading.Event()
        rp._steps._stepper._thread.submit(release.wait, 10.0)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        threading.Timer(0.3, release.set).start()
        SEEN.clear()
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert SEEN and host_ptr not in SEEN, "a gated call computed on the host weights"
        rp.synchronize()
        SEEN.clear()
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)  # nothing in flight now
        assert SEEN and all(p == host_ptr for p in SEEN)
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
