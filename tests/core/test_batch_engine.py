"""The engine splits and merges through ``roundpipe_core.batch``: spec forms, packed data
and averaged 0-dim outputs, each checked against plain PyTorch (values and gradients)."""

from __future__ import annotations

import copy

import pytest
import torch
from _util import assert_close_rel, assert_grads_match, mlp, reference_grads, sum_sq
from torch import nn

from roundpipe_core import RoundPipe, RoundPipePackedData, RoundPipeRunConfig
from roundpipe_core.batch import Replicate, TensorChunkSpec


class WithConstant(nn.Module):
    """Returns its input transformed and a constant 0-dim tensor (a count, a flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict:
        return {"y": self.lin(x), "c": torch.tensor(233.0)}


class MeanLoss(nn.Module):
    """The last layer: the mean squared activation, a 0-dim output per microbatch."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h**2).mean()


class Scaled(nn.Module):
    """A first layer with two inputs: ``scale`` is the same for every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 12)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_constant_scalar_output_merges_to_itself(n: int) -> None:
    # 0-dim outputs are averaged over microbatches (the published rule): 233 stays 233
    rp = RoundPipe(WithConstant(), devices=2)
    try:
        x = torch.randn(12, 8)
        with torch.no_grad():
            out = rp(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=n))
        assert out["c"].item() == 233.0
        assert_close_rel(out["y"], rp.model(x)["y"].detach(), what="y")
        loss, outs = rp.forward_backward(
            input_args=(x,),
            loss_fn=lambda o, _: o["y"].sum(),
            return_outputs=True,
            run_config=RoundPipeRunConfig(num_microbatch=n),
        )
        assert outs["c"].item() == 233.0
        # losses are per-microbatch sums, so the call's loss is their sum, not their mean
        assert_close_rel(loss, rp.model(x)["y"].sum().detach(), what="loss")
    finally:
        rp.close()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_averaged_scalar_output_backpropagates_like_pytorch(n: int) -> None:
    # equal microbatches: the mean of per-microbatch means is the whole batch's mean, and
    # each microbatch's share of the gradient is g / n
    model = nn.Sequential(*mlp(4, seed=1), MeanLoss())
    ref = copy.deepcopy(model)
    x = torch.randn(12, 8)
    ref_loss = ref(x)
    ref_loss.backward()
    rp = RoundPipe(model, devices=2)
    try:
        loss = rp(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=n))
        assert loss.dim() == 0
        assert_close_rel(loss.detach(), ref_loss.detach(), what="loss")
        loss.backward()
        assert_grads_match(rp, {k: p.grad for k, p in ref.named_parameters()})
    finally:
        rp.close()


def test_chunk_specs_split_and_merge_along_another_dim() -> None:
    # (batch, tokens, features) cut along the tokens: Linear acts per token, so each
    # microbatch computes its columns of the whole output
    model = mlp(4, seed=2)
    x = torch.randn(2, 9, 8)
    y = torch.randn(2, 9, 4)
    xr = x.clone().requires_grad_(True)
    ref = copy.deepcopy(model)
    sum_sq(ref(xr), y).backward()
    cfg = RoundPipeRunConfig(
        num_microbatch=3,
        split_input=((TensorChunkSpec(1),), {}),
        merge_output=TensorChunkSpec(1),
    )
    rp = RoundPipe(model, devices=2, model_run_config=cfg)
    try:
        xi = x.clone().requires_grad_(True)
        out = rp(xi)
        assert out.shape == (2, 9, 4)
        sum_sq(out, y).backward()
        assert_grads_match(rp, {k: p.grad for k, p in ref.named_parameters()})
        assert xi.grad is not None and xr.grad is not None
        assert_close_rel(xi.grad, xr.grad, what="input grad")
        # labels cut by their own spec in forward_backward
        rp.zero_grad()
        for p in rp.optim_parameters():
            p.grad = None
        loss = rp.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=sum_sq,
            run_config=RoundPipeRunConfig(split_label=TensorChunkSpec(1)),
        )
        assert_close_rel(loss, sum_sq(ref(x), y).detach(), what="loss")
        assert_grads_match(rp, {k: p.grad for k, p in ref.named_parameters()})
    finally:
        rp.close()


def test_replicated_input_gets_the_sum_of_its_microbatch_gradients() -> None:
    model = nn.Sequential(Scaled(), *mlp(3, seed=3)[1:])
    x = torch.randn(10, 8)
    scale = torch.linspace(0.5, 1.5, 12)
    y = torch.randn(10, 4)
    ref = copy.deepcopy(model)
    sr = scale.clone().requires_grad_(True)
    sum_sq(ref[1:](ref[0](x, sr)), y).backward()
    cfg = RoundPipeRunConfig(num_microbatch=3, split_input=((TensorChunkSpec(0), Replicate), {}))
    rp = RoundPipe(model, devices=2, model_run_config=cfg)
    try:
        si = scale.clone().requires_grad_(True)
        sum_sq(rp(x, si), y).backward()
        assert_grads_match(rp, {k: p.grad for k, p in ref.named_parameters()})
        assert si.grad is not None and sr.grad is not None
        assert_close_rel(si.grad, sr.grad, what="replicated input grad")
    finally:
        rp.close()


def test_packed_outputs_feed_the_next_roundpipe_already_split() -> None:
    first, second = mlp(3, seed=4), mlp(3, seed=5)
    second[0] = nn.Linear(4, 12)
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    rp1 = RoundPipe(copy.deepcopy(first), devices=2)
    rp2 = RoundPipe(copy.deepcopy(second), devices=2)
    try:
        with torch.no_grad():
            packed = rp1(
                x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=False)
            )
        assert isinstance(packed, RoundPipePackedData) and len(packed) == 3
        assert_close_rel(torch.cat(list(packed)), first(x).detach(), what="packed values")
        # the packed data sets the second call's microbatches; labels follow its rows
        loss = rp2.forward_backward(input_args=(packed,), label=y, loss_fn=sum_sq)
        h = first(x).detach()
        ref_loss, ref_grads = reference_grads(second, h, y)
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp2, ref_grads)
    finally:
        rp1.close()
        rp2.close()


def test_forward_with_grad_refuses_only_merges_without_an_adjoint() -> None:
    rp = RoundPipe(mlp(3), devices=2)
    x = torch.randn(6, 8)
    try:
        for merge in (lambda outs: torch.cat(outs), False):
            with pytest.raises(ValueError, match="merge_output"):
                rp(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=merge))
        out = rp(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=True))
        assert out.requires_grad
        with torch.no_grad():  # the same merges are fine for inference
            cat = rp(
                x, roundpipe_run_config=RoundPipeRunConfig(merge_output=lambda o: torch.cat(o))
            )
        assert_close_rel(cat, out.detach(), what="function merge")
    finally:
        rp.close()


def test_bad_specs_fail_when_the_config_meets_the_engine() -> None:
    with pytest.raises(TypeError, match="split_input"):
        RoundPipe(mlp(3), devices=1, model_run_config=RoundPipeRunConfig(split_input="rows"))
    with pytest.raises(TypeError, match="merge_output"):
        RoundPipe(mlp(3), devices=1, model_run_config=RoundPipeRunConfig(merge_output=3))


def test_a_split_function_in_the_published_form_runs_like_pytorch() -> None:
    # split_input(args, kwargs, n) -> (args_list, kwargs_list), as the published RoundPipe
    def split_input(args: tuple, kwargs: dict, n: int) -> tuple[list, list]:
        (x,) = args
        return [(c,) for c in x.chunk(n)], [{} for _ in range(n)]

    def split_label(label: torch.Tensor, n: int) -> list:
        return list(label.chunk(n))

    model = mlp(4, seed=6)
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    ref_loss, ref_grads = reference_grads(model, x, y)
    cfg = RoundPipeRunConfig(num_microbatch=3, split_input=split_input, split_label=split_label)
    rp = RoundPipe(model, devices=2)
    try:
        loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=sum_sq, run_config=cfg)
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref_grads)
    finally:
        rp.close()
