"""The engine's contract at its edges: failed calls leave no trace, the caller's random
stream is left alone, bad arguments fail before compute, upstream-compatible call forms."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from _util import assert_close_rel, assert_grads_match, master_grads, mlp, reference_grads, sum_sq
from torch import nn

import roundpipe_core
from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

P = ModelExecutePlan

# a fused stage for layers 3..5, then a backward stage for layers 0..2 (which fails once)
_TWO_BACKWARD_STAGES = P([range(0, 3)], [range(3, 6), range(0, 3)])


def _data(batch: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)


class _FailingBackward(nn.Module):
    """A linear layer whose backward raises while ``FAILS["left"]`` is positive."""

    FAILS = {"left": 0}

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(self._maybe_fail)
        return y

    @classmethod
    def _maybe_fail(cls, grad: torch.Tensor) -> torch.Tensor:
        if cls.FAILS["left"] > 0:
            cls.FAILS["left"] -= 1
            raise RuntimeError("injected backward failure")
        return grad


def _failing_model() -> nn.Sequential:
    model = mlp()
    model[0] = _FailingBackward(model[0])
    return model


# -- a failed call leaves no trace -------------------------------------------------------
def test_failed_blocking_forward_backward_leaves_no_gradients() -> None:
    x, y = _data()
    clean = RoundPipe(_failing_model(), devices="cpu:2")
    rp = RoundPipe(_failing_model(), devices="cpu:2")
    cfg = RoundPipeRunConfig(execute_plan=_TWO_BACKWARD_STAGES, num_microbatch=2)
    try:
        clean.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
        _FailingBackward.FAILS["left"] = 1
        with pytest.raises(RuntimeError, match="injected backward failure"):
            rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
        # the fused stage (layers 3..5) finished before the failure: nothing of it stays
        assert all(m.grad is None for m in rp.optim_parameters())
        rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
        got, want = master_grads(rp), master_grads(clean)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name
    finally:
        _FailingBackward.FAILS["left"] = 0
        clean.close()
        rp.close()


def test_failed_backward_of_forward_leaves_no_gradients() -> None:
    x, y = _data()
    rp = RoundPipe(_failing_model(), devices="cpu:2")
    cfg = RoundPipeRunConfig(execute_plan=P([range(0, 3), range(3, 6)], [range(3, 6), range(0, 3)]))
    try:
        out = rp(x, roundpipe_run_config=cfg)
        _FailingBackward.FAILS["left"] = 1
        with pytest.raises(RuntimeError, match="injected backward failure"):
            sum_sq(out, y).backward()
        assert all(m.grad is None for m in rp.optim_parameters())
    finally:
        _FailingBackward.FAILS["left"] = 0
        rp.close()


# -- the caller's random stream ------------------------------------------------------------
def test_calls_leave_the_global_generator_alone() -> None:
    x, y = _data()
    rp = RoundPipe(mlp(), devices="cpu:2")
    try:
        torch.manual_seed(3)
        state = torch.get_rng_state()
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False).result(timeout=60)
        with torch.no_grad():
            rp(x)
        sum_sq(rp(x), y).backward()
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        rp.close()


def test_dropout_masks_differ_between_calls() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    x = torch.randn(6, 8)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        with torch.no_grad():
            a, b = rp(x), rp(x)
        assert not torch.equal(a, b)
    finally:
        rp.close()


# -- losses ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loss_fn",
    [lambda out, y: torch.tensor(1.0), lambda out, y: sum_sq(out, y).detach()],
    ids=["constant", "detached"],
)
def test_loss_without_gradient_raises_like_backward(loss_fn) -> None:
    x, y = _data()
    rp = RoundPipe(mlp(), devices="cpu:2")
    try:
        with pytest.raises(RuntimeError, match="does not require grad"):
            rp.forward_backward((x,), label=y, loss_fn=loss_fn)
        assert all(m.grad is None for m in rp.optim_parameters())
    finally:
        rp.close()


def test_default_loss_fn_is_the_output() -> None:
    """Upstream's default ``loss_fn(outputs, labels) = outputs``: the model computes its loss."""

    class SumSq(nn.Module):
        def forward(self, out: torch.Tensor) -> torch.Tensor:
            return (out**2).sum()

    model = mlp()
    x, _ = _data()
    ref_loss, ref = reference_grads(nn.Sequential(*model, SumSq()), x, None, lambda o, _: o)
    rp = RoundPipe(nn.Sequential(*model, SumSq()), devices="cpu:2")
    try:
        loss = rp.forward_backward((x,))
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref)
    finally:
        rp.close()


@pytest.mark.parametrize("container", [tuple, list])
def test_several_losses_backprop_their_sum_and_come_back_summed(container) -> None:
    model = mlp()
    x, y = _data()

    def two(out: torch.Tensor, t: torch.Tensor):
        return container([sum_sq(out, t), out.abs().sum() * 0.5])

    ref_model = copy.deepcopy(model)
    out = ref_model(x)
    parts = two(out, y)
    sum(parts).backward()
    rp = RoundPipe(model, devices="cpu:2")
    try:
        losses = rp.forward_backward((x,), label=y, loss_fn=two)
        assert type(losses) is container and len(losses) == 2
        for got, want in zip(losses, parts):
            assert_close_rel(got, want.detach(), what="loss part")
        assert_grads_match(rp, {n: p.grad for n, p in ref_model.named_parameters()})
    finally:
        rp.close()


# -- bad input fails before compute ----------------------------------------------------------
def test_bad_output_device_fails_before_compute() -> None:
    x, y = _data()
    rp = RoundPipe(mlp(), devices="cpu:2")
    try:
        with pytest.raises(ValueError, match="output_device.*'nonsense'"):
            rp.forward_backward(
                (x,),
                label=y,
                loss_fn=sum_sq,
                run_config=RoundPipeRunConfig(output_device="nonsense"),
            )
        assert rp.last_call.schedule == []  # nothing ran
        with pytest.raises(ValueError, match="output_device"):
            RoundPipe(
                mlp(), devices=rp.pool, model_run_config=RoundPipeRunConfig(output_device="gpu0")
            )
    finally:
        rp.close()


def test_split_input_must_return_a_list() -> None:
    x, y = _data()
    rp = RoundPipe(mlp(), devices="cpu:2")
    try:
        cfg = RoundPipeRunConfig(split_input=lambda args, kwargs, n: 3)
        with pytest.raises(TypeError, match="split_input.*int"):
            rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
    finally:
        rp.close()


def test_calls_after_close_say_the_roundpipe_is_closed() -> None:
    x, y = _data()
    rp = RoundPipe(mlp(), devices="cpu:2")
    rp.close()
    rp.close()  # twice is fine
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    for call in (
        lambda: rp.step(opt.step),
        lambda: rp.forward_backward((x,), label=y, loss_fn=sum_sq),
        lambda: rp(x),
    ):
        with pytest.raises(RuntimeError, match="this RoundPipe .*is closed"):
            call()


# -- upstream call forms -------------------------------------------------------------------
def test_step_forwards_arguments_to_step_fn() -> None:
    x, y = _data()
    rp = RoundPipe(mlp(), devices="cpu:2")
    seen = []
    try:
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.step(lambda a, b=0: seen.append((a, b)), True, 1, b=2)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
        rp.step(lambda a, b=0: seen.append((a, b)), False, 3, b=4)  # deferred behind the run
        assert seen == [(1, 2), (3, 4)]
    finally:
        rp.close()


def test_optim_named_parameters_prefix_and_duplicates() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        names = [n for n, _ in rp.optim_named_parameters()]
        assert names == ["0.weight", "0.bias"]
        named = rp.optim_named_parameters(prefix="net", remove_duplicate=False)
        assert [n for n, _ in named] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
        assert named[0][1] is named[2][1]  # one master per parameter
        assert named[0][1] is rp.master_param(shared.weight)
    finally:
        rp.close()


def test_version_matches_the_package_metadata() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M)
    assert version is not None
    assert roundpipe_core.__version__ == version.group(1)


def test_attribute_writes_and_deletes_fall_through_to_the_original_model() -> None:
    model = mlp()
    rp = RoundPipe(model, devices="cpu:2")
    other = nn.Linear(2, 2)
    try:
        rp.custom_flag = 3
        assert model.custom_flag == 3 and "custom_flag" not in rp.__dict__
        assert rp.custom_flag == 3
        del rp.custom_flag
        assert not hasattr(model, "custom_flag")
        rp.name = "renamed"  # RoundPipe's own attribute stays on RoundPipe
        assert rp.name == "renamed" and not hasattr(model, "name")
        rp.loss_multiplier = None
        assert "loss_multiplier" not in model.__dict__
        rp.set_original_model(other)
        rp.tag = "x"
        assert other.tag == "x" and not hasattr(model, "tag")
        assert rp.in_features == 2  # reads follow the new original model too
        rp.train(False)  # nn.Module's own state is RoundPipe's
        assert not rp.training
    finally:
        rp.close()


# -- synchronize() shows the gradients on the wrapped module ------------------------------
@pytest.mark.parametrize("set_to_none", [True, False])
def test_optimizer_over_the_wrapped_module_after_synchronize(set_to_none: bool) -> None:
    """Upstream's minimum loop: an optimizer over the module's own parameters."""
    model = mlp()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices="cpu:2")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    try:
        for it in range(3):
            x, y = _data(seed=it)
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
            rp.synchronize()
            sum_sq(ref(x), y).backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert_close_rel(p.grad, q.grad, what=f"{n}.grad at {it}")
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            ref_opt.step()
            ref_opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close_rel(p.detach(), q.detach(), what=n)
    finally:
        rp.close()


def test_synchronize_then_step_on_the_masters_consumes_the_gradients_once() -> None:
    model = mlp()
    x, y = _data()
    _, ref = reference_grads(model, x, y)
    rp = RoundPipe(model, devices="cpu:2")
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.0)  # weights stay: ref grads hold
    seen: list[dict[str, torch.Tensor]] = []
    try:
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.synchronize()  # shown on the module; the masters keep them for the step
        assert_grads_match(rp, ref)
        rp.step(lambda: (seen.append(master_grads(rp)), opt.step(), opt.zero_grad()), False)
        assert set(seen[0]) == set(ref)
        for n in ref:
            assert_close_rel(seen[0][n], ref[n], what=n)
        assert all(p.grad is None for p in model.parameters())
        assert all(m.grad is None for m in rp.optim_parameters())
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert_grads_match(rp, ref)  # this call's gradients only
    finally:
        rp.close()


def test_synchronize_shows_half_precision_copies_and_keeps_fp32_masters() -> None:
    model = mlp().to(torch.bfloat16)
    x, y = _data()
    rp = RoundPipe(model, devices="cpu:2", optim_dtype=torch.float32)
    try:
        rp.forward_backward((x.bfloat16(),), label=y.bfloat16(), loss_fn=sum_sq)
        rp.synchronize()
        for p in model.parameters():
            master = rp.master_param(p)
            assert p.grad is not None and p.grad.dtype == torch.bfloat16
            assert master.grad.dtype == torch.float32
            assert torch.equal(p.grad, master.grad.bfloat16())
        before = {id(m): m.grad.clone() for m in rp.optim_parameters()}
        rp.forward_backward((x.bfloat16(),), label=y.bfloat16(), loss_fn=sum_sq)
        for m in rp.optim_parameters():  # untouched copies: the fp32 masters accumulate on
            assert torch.allclose(m.grad, 2 * before[id(m)], rtol=1e-2, atol=1e-3)
        assert all(p.grad is None for p in model.parameters())
    finally:
        rp.close()


def test_default_plan_is_made_for_the_microbatches_the_batch_gives(monkeypatch) -> None:
    """num_microbatch=10**6 on a batch of 6 plans 6 microbatches, not a million."""
    planned: list[int | None] = []
    auto = ModelExecutePlan.auto

    def recording_auto(run_type, *models, num_microbatch=None, **kw):
        planned.append(num_microbatch)
        return auto(run_type, *models, num_microbatch=num_microbatch, **kw)

    monkeypatch.setattr(ModelExecutePlan, "auto", staticmethod(recording_auto))
    x, y = _data(batch=6)
    model = mlp()
    _, ref = reference_grads(model, x, y)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        rp.forward_backward(
            (x,), label=y, loss_fn=sum_sq, run_config=RoundPipeRunConfig(num_microbatch=10**6)
        )
        assert planned and max(p for p in planned if p is not None) == 6
        assert len({j.microbatches for j in rp.last_call.schedule if len(j.microbatches) == 6}) >= 1
        assert_grads_match(rp, ref)
    finally:
        rp.close()


def test_layers_compiled_in_place_are_refused() -> None:
    model = mlp()
    model[2].compile()  # the compiled function stays bound to the host module
    with pytest.raises(ValueError, match=r"layer 2 .*compiled in place.*torch\.compile"):
        RoundPipe(model, devices="cpu:2")
    model = mlp()
    rp = RoundPipe(model, devices="cpu:2")
    try:
        model[1][0].compile()  # after wrapping: refused at the next call, before compute
        with pytest.raises(ValueError, match=r"layer 1 \(submodule '0'\)"):
            rp(torch.randn(3, 8))
    finally:
        rp.close()
