"""What a user of the core API can get wrong, or that used to go silently wrong
(issue 23): each case either gives the right numbers or a clear error."""

from __future__ import annotations

import threading

import pytest
import torch
from _util import mlp, sum_sq

from roundpipe_core import RoundPipe


def _train(zero_outside: bool, steps: int = 4) -> dict[str, torch.Tensor]:
    """SGD with momentum on an asynchronous step; ``zero_outside``: ``opt.zero_grad()``
    through ``after_step`` (outside ``step_fn``) instead of inside it. The step is slow,
    so a zero_grad that did not wait for it would clear gradients it still reads."""
    rp = RoundPipe(mlp(), devices="cpu:2", shared_masters=False)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05, momentum=0.9)
    release = threading.Event()

    def step() -> None:
        release.wait(0.05)  # still running when the caller moves on
        opt.step()
        if not zero_outside:
            opt.zero_grad()

    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.step(step, is_async=True)
        if zero_outside:
            rp.after_step(opt.zero_grad)
    rp.synchronize()
    out = {n: p.detach().clone() for n, p in rp.optim_named_parameters()}
    rp.close()
    return out


def test_zero_grad_after_step_runs_in_order_with_the_async_step() -> None:
    want = _train(zero_outside=False)
    got = _train(zero_outside=True)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_after_step_refuses_a_non_callable_and_raises_its_error() -> None:
    rp = RoundPipe(mlp(), devices="cpu:1")
    with pytest.raises(TypeError, match="after_step needs a callable"):
        rp.after_step(None)  # type: ignore[arg-type]

    def boom() -> None:
        raise ValueError("zero_grad failed")

    rp.step(lambda: threading.Event().wait(0.05), is_async=True)
    rp.after_step(boom)
    with pytest.raises(ValueError, match="zero_grad failed"):
        rp.synchronize()
    rp.synchronize()  # raised once; the next call works
    rp.close()


def test_fused_optimizer_refuses_state_of_other_shapes() -> None:
    """torch's fused kernels read a momentum buffer of the wrong size out of bounds (heap
    corruption) and train on a reordered state to NaN; the state is checked at load."""
    from roundpipe_core import optim

    a, b = torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(5))
    src = torch.optim.AdamW([a, b], lr=0.1)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    src.step()
    fused = optim.AdamW([b, a], lr=0.1)  # the same parameters, listed in the other order
    assert fused.param_groups[0]["fused"]
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter .*\(4, 3\).*\(5,\)"):
        fused.load_state_dict(src.state_dict())
    ok = optim.AdamW([a, b], lr=0.1)
    ok.load_state_dict(src.state_dict())  # same order: accepted
