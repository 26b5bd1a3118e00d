"""What a user of the core API can get wrong, or that used to go silently wrong
(issue 23): each case either gives the right numbers or a clear error."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from _util import mlp, sum_sq

from roundpipe_core import RoundPipe, RoundPipeRunConfig


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
    rp = RoundPipe(mlp(), devices="cpu:1", shared_masters=False)  # an asynchronous step
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


def test_post_accumulate_gradient_hooks_are_refused_naming_the_parameter() -> None:
    """A post-accumulate hook would never run (devices backpropagate into copies): refused
    at wrap time instead of silently ignored. (Tensor hooks are honoured: test_hooks.py.)"""
    net = mlp()
    hook = net[1][0].weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(
        ValueError,
        match=r"parameter '1\.0\.weight' has a gradient hook \(register_post_accumulate_grad_hook\)",
    ):
        RoundPipe(net, devices="cpu:1")
    hook.remove()
    RoundPipe(net, devices="cpu:1").close()  # accepted once removed


def test_forward_backward_refuses_an_input_that_requires_grad() -> None:
    """forward_backward backpropagates into the parameters only; an input that requires
    grad would silently get no .grad (rp(x).backward() does give one)."""
    rp = RoundPipe(mlp(), devices="cpu:2")
    x, y = torch.randn(6, 8, requires_grad=True), torch.randn(6, 4)
    with pytest.raises(
        ValueError, match=r"tensor 0 of input_args \(shape \(6, 8\)\) requires grad"
    ):
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
    assert all(p.grad is None for p in rp.optim_parameters())  # refused before compute
    with pytest.raises(ValueError, match="input_kwargs"):
        rp.forward_backward((), input_kwargs={"input": x}, label=y, loss_fn=sum_sq)
    rp.forward_backward((x.detach(),), label=y, loss_fn=sum_sq)  # the fix works
    sum_sq(rp(x), y).backward()  # and the autograd path fills x.grad
    assert x.grad is not None and x.grad.abs().sum() > 0
    rp.close()


def test_two_roundpipes_over_the_same_parameters_are_refused() -> None:
    """Each would step its own master copy and one update would be lost."""
    net = mlp()
    first = RoundPipe(net, devices="cpu:1", name="first")
    with pytest.raises(
        ValueError, match=r"parameter '0\.weight' is already trained by RoundPipe 'first'"
    ):
        RoundPipe(net, devices="cpu:1")
    with pytest.raises(ValueError, match="already trained"):
        RoundPipe(torch.nn.Sequential(torch.nn.Tanh(), net[0]), devices="cpu:1")  # a part
    first.close()
    RoundPipe(net, devices="cpu:1").close()  # free again once the first is closed
    RoundPipe(mlp(), devices="cpu:1").close()  # another model is unaffected


def test_an_optimizer_over_the_model_weights_is_warned_about() -> None:
    """torch.optim.SGD(rp.parameters()) holds the model's weights, which get no gradients
    (the masters do): it trains nothing. After a few such steps RoundPipe warns."""
    rp = RoundPipe(mlp(), devices="cpu:1", shared_masters=False)
    wrong = torch.optim.SGD(rp.parameters(), lr=0.1)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    with pytest.warns(RuntimeWarning, match=r"rp\.optim_parameters\(\)"):
        for _ in range(3):
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
            rp.step(lambda: (wrong.step(), wrong.zero_grad()), is_async=False)
    rp.close()
    with warnings.catch_warnings():  # the right optimizer: no warning
        warnings.simplefilter("error")
        fresh = RoundPipe(mlp(), devices="cpu:1", shared_masters=False)
        opt = torch.optim.SGD(fresh.optim_parameters(), lr=0.1)
        for _ in range(4):
            fresh.forward_backward((x,), label=y, loss_fn=sum_sq)
            fresh.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        fresh.close()


@pytest.mark.parametrize("right", [True, False])
def test_a_fused_optimizer_is_seen_to_train(right: bool) -> None:
    """torch's fused kernels (AdamW(fused=True), what fuse_optimizer=True runs) update the
    masters without bumping their version counters: the right optimizer must not be
    warned about, the wrong one still is."""
    rp = RoundPipe(mlp(), devices="cpu:1", shared_masters=False)
    params = rp.optim_parameters() if right else rp.parameters()
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(4):
                rp.forward_backward((x,), label=y, loss_fn=sum_sq)
                rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    finally:
        rp.close()
    idle = [w for w in seen if "updated none of the master copies" in str(w.message)]
    assert len(idle) == (0 if right else 1), [str(w.message) for w in idle]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("inner", ["synchronize", "wait_step", "step", "forward_backward"])
def test_a_call_inside_step_fn_raises_instead_of_deadlocking(inner: str) -> None:
    rp = RoundPipe(mlp(), devices="cpu:2", shared_masters=False)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    calls = {
        "synchronize": rp.synchronize,
        "wait_step": rp.wait_step,
        "step": lambda: rp.step(lambda: None),
        "forward_backward": lambda: rp.forward_backward((x,), label=y, loss_fn=sum_sq),
    }
    rp.forward_backward((x,), label=y, loss_fn=sum_sq)
    with pytest.raises(RuntimeError, match=r"inside step_fn, on the optimizer thread"):
        rp.step(calls[inner], is_async=False)
    rp.forward_backward((x,), label=y, loss_fn=sum_sq)  # the next call works
    rp.step(lambda: None, is_async=False)
    rp.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("inner", ["forward_backward", "forward"])
def test_a_call_inside_loss_fn_raises_instead_of_deadlocking(inner: str) -> None:
    rp = RoundPipe(mlp(), devices="cpu:2")
    x, y = torch.randn(6, 8), torch.randn(6, 4)

    def nested_loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if inner == "forward":
            rp(x)
        else:
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        return sum_sq(out, label)

    with pytest.raises(RuntimeError, match=r"on one of its own worker threads"):
        rp.forward_backward((x,), label=y, loss_fn=nested_loss)
    assert all(p.grad is None for p in rp.optim_parameters())
    rp.forward_backward((x,), label=y, loss_fn=sum_sq)  # the next call works
    rp.close()


def test_an_output_device_this_machine_lacks_fails_before_compute() -> None:
    rp = RoundPipe(mlp(), devices="cpu:2")
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    bad = ["cuda:99"] + ([] if torch.cuda.is_available() else ["cuda:0", "cuda"])
    for device in bad:
        cfg = RoundPipeRunConfig(output_device=device)
        with pytest.raises(ValueError, match=r"output_device='cuda(:\d+)?': this machine has"):
            rp.forward_backward((x,), label=y, loss_fn=sum_sq, return_outputs=True, run_config=cfg)
        assert all(p.grad is None for p in rp.optim_parameters())  # nothing was added
    rp.close()


def test_a_failing_loss_fn_is_named_as_the_loss_function() -> None:
    rp = RoundPipe(mlp(), devices="cpu:2")
    x, y = torch.randn(6, 8), torch.randn(6, 4)

    def bad_loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        raise KeyError("no such label")

    with pytest.raises(KeyError) as info:
        rp.forward_backward(
            (x,), label=y, loss_fn=bad_loss, run_config=RoundPipeRunConfig(num_microbatch=2)
        )
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised in the loss function" in notes and "bad_loss" in notes, notes
    assert "microbatch 0" in notes and "layers" not in notes, notes
    rp.close()


def test_grad_scaler_accepts_torchs_signature() -> None:
    from roundpipe_core.amp import GradScaler

    assert GradScaler("cpu").get_scale() == 2.0**16
    assert GradScaler(device="cpu", init_scale=8.0).get_scale() == 8.0
    assert GradScaler("cpu", 1024.0).get_scale() == 1024.0  # torch's order: device first
    assert GradScaler(torch.device("cpu"), 4.0, 3.0).state_dict()["growth_factor"] == 3.0
    assert GradScaler(16.0).get_scale() == 16.0  # this class's own order still works
    with pytest.raises(TypeError, match="multiple values for 'init_scale'"):
        GradScaler(2.0, init_scale=4.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale'"):
        GradScaler(scale=4.0)
    with pytest.raises(TypeError, match="device twice"):
        GradScaler("cpu", device="cpu")


def test_a_model_on_the_meta_device_is_refused_at_construction() -> None:
    with torch.device("meta"):
        net = mlp()
    with pytest.raises(ValueError, match=r"parameter '0\.weight' is on the meta device"):
        RoundPipe(net, devices="cpu:1")


@pytest.mark.parametrize("args", [(0, 2), (4, 0), (-1, 2), (2.5, 2)])
def test_uniform_plan_refuses_non_positive_sizes(args: tuple) -> None:
    from roundpipe_core import ModelExecutePlan

    with pytest.raises(ValueError, match="ModelExecutePlan.uniform: num_"):
        ModelExecutePlan.uniform(*args)
    assert len(ModelExecutePlan.uniform(3, 5).bwd_plan) == 3  # more stages than layers: clamped
