"""Bad input gets clear errors; a failure in a worker reaches the caller; nothing hangs."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _util import mlp, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)
        self.armed = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x):
        if self.armed.item() > 0:
            raise FloatingPointError("boom in layer")
        return self.lin(x)


@pytest.mark.parametrize("kind", ["fused", "infer", "train"])
def test_layer_exception_reaches_caller_with_layer_index_then_next_call_works(kind):
    model = mlp()
    bomb = Exploding()
    model[3] = bomb
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(model, devices="cpu:3")
    try:
        with torch.no_grad():
            bomb.armed.fill_(1.0)
        t0 = time.monotonic()
        with pytest.raises(FloatingPointError, match="boom in layer") as info:
            if kind == "fused":
                rp.forward_backward((x,), label=y, loss_fn=sum_sq)
            elif kind == "infer":
                with torch.no_grad():
                    rp(x)
            else:
                sum_sq(rp(x), y).backward()
        assert time.monotonic() - t0 < 10.0  # the other workers stop waiting: no hang
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "layer 3" in notes
        with torch.no_grad():
            bomb.armed.fill_(0.0)
        loss = rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert torch.isfinite(loss)
    finally:
        rp.close()


def test_bad_loss_fn_results_are_type_errors():
    rp = RoundPipe(mlp(), devices="cpu:2")
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    try:
        with pytest.raises(TypeError, match="loss_fn"):
            rp.forward_backward((x,), label=y)
        with pytest.raises(TypeError, match="scalar"):
            rp.forward_backward((x,), label=y, loss_fn=lambda o, t: (o - t) ** 2)
        assert torch.isfinite(rp.forward_backward((x,), label=y, loss_fn=sum_sq))
    finally:
        rp.close()


def test_constructor_and_config_validation():
    with pytest.raises(TypeError, match="nn.Module"):
        RoundPipe("not a model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pin_model"):
        RoundPipe(mlp(), pin_model="sometimes", devices="cpu:1")
    with pytest.raises(TypeError, match="optim_dtype"):
        RoundPipe(mlp(), optim_dtype=torch.int32, devices="cpu:1")
    with pytest.raises(ValueError, match="recompute_grain"):
        RoundPipe(
            mlp(), model_run_config=RoundPipeRunConfig(recompute_grain="block"), devices="cpu:1"
        )
    with pytest.raises(ValueError, match="num_microbatch"):
        RoundPipe(mlp(), model_run_config=RoundPipeRunConfig(num_microbatch=0), devices="cpu:1")
    with pytest.raises(ValueError, match="empty"):
        RoundPipe(nn.Sequential(), devices="cpu:1")
    with pytest.raises(ValueError, match="cpu:N"):
        RoundPipe(mlp(), devices="cpu:x")
    with pytest.raises(ValueError, match=">= 1"):
        RoundPipe(mlp(), devices=0)


def test_invalid_plan_is_rejected_before_running():
    rp = RoundPipe(mlp(), devices="cpu:2")
    try:
        bad = ModelExecutePlan(
            [range(0, 3)], [range(5, 6), range(3, 5), range(0, 3)]
        )  # fwd ends at 2, fused starts at 5
        with pytest.raises(ValueError, match="must end where the first backward stage starts"):
            rp.forward_backward(
                (torch.randn(3, 8),),
                label=torch.randn(3, 4),
                loss_fn=sum_sq,
                run_config=RoundPipeRunConfig(execute_plan=bad),
            )
        owners = ModelExecutePlan([range(0, 6)], [range(0, 6)], fwd_owners=[5])
        with pytest.raises(ValueError, match="only 2 device"):
            with torch.no_grad():
                rp(torch.randn(3, 8), roundpipe_run_config=RoundPipeRunConfig(execute_plan=owners))
    finally:
        rp.close()


def test_close_stops_worker_threads():
    before = {t.name for t in threading.enumerate()}
    rp = RoundPipe(mlp(), devices="cpu:3")
    rp.forward_backward((torch.randn(4, 8),), label=torch.randn(4, 4), loss_fn=sum_sq)
    rp.close()
    for w in rp.pool.workers:
        w._thread.join(5)
        assert not w._thread.is_alive()
    leftover = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not any(name.startswith("roundpipe-") for name in leftover), leftover
    with pytest.raises(RuntimeError, match="closed"):
        rp.forward_backward((torch.randn(4, 8),), label=torch.randn(4, 4), loss_fn=sum_sq)


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a plain attribute written in forward: lost on a device copy
        return self.lin(x)


def test_forward_rule_violation_warns_naming_the_layer_once():
    model = mlp()
    model[2] = _Counting()
    rp = RoundPipe(model, devices="cpu:2")
    try:
        with pytest.warns(RuntimeWarning, match=r"layer 2 .*'calls'"):
            rp.forward_backward((torch.randn(4, 8),), label=torch.randn(4, 4), loss_fn=sum_sq)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # checked on the first forward only
            rp.forward_backward((torch.randn(4, 8),), label=torch.randn(4, 4), loss_fn=sum_sq)
    finally:
        rp.close()
