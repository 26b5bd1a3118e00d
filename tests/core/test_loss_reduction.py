"""forward_backward(loss_reduction=...): "sum" adds the microbatch losses up (the published
contract), "mean" weights each by its share of the batch rows, so a loss_fn returning a
batch mean gives plain PyTorch's full-batch mean loss and gradients."""

from __future__ import annotations

import pytest
import torch
from _util import assert_close_rel, assert_grads_match, mlp, reference_grads, sum_sq
from torch import nn

from roundpipe_core import RoundPipe, RoundPipeRunConfig
from roundpipe_core.amp import GradScaler
from roundpipe_core.loss import batch_normalized


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)  # a batch mean


def _data(batch: int = 10, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)


def _cfg(n: int) -> RoundPipeRunConfig:
    return RoundPipeRunConfig(num_microbatch=n)


@pytest.mark.parametrize("num_microbatch", [1, 3, 4])
@pytest.mark.parametrize("blocking", [True, False])
def test_mean_of_a_batch_mean_loss_is_plain_pytorch(num_microbatch, blocking):
    """Batch 10 over 3 (4,3,3) and 4 (3,3,2,2) microbatches: uneven shares."""
    model = mlp()
    x, y = _data()
    ref_loss, ref = reference_grads(model, x, y, loss_fn=mse)
    rp = RoundPipe(model, devices="cpu:2", loss_reduction="mean")
    try:
        loss = rp.forward_backward(
            (x,), label=y, loss_fn=mse, run_config=_cfg(num_microbatch), blocking=blocking
        )
        loss = loss if blocking else loss.result()
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref)
    finally:
        rp.close()


def test_sum_is_the_default_and_keeps_the_published_contract():
    model = mlp()
    x, y = _data()
    ref_loss, ref = reference_grads(model, x, y, loss_fn=sum_sq)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        assert rp.loss_reduction == "sum"
        loss = rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=_cfg(3))
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref)
        # the same mean loss under "sum" is the sum of three microbatch means, not the mean
        summed = rp.forward_backward((x,), label=y, loss_fn=mse, run_config=_cfg(3))
        assert summed.item() > 2 * mse(model(x), y).item()
    finally:
        rp.close()


def test_call_argument_overrides_the_attribute_and_tuple_losses_are_weighted_each():
    model = mlp()
    x, y = _data()
    ref = mlp()

    def two(out, lbl):
        return mse(out, lbl), out.abs().mean()

    a, b = two(ref(x), y)
    (a + b).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    rp = RoundPipe(model, devices="cpu:2")  # attribute "sum", the call asks for "mean"
    try:
        got = rp.forward_backward(
            (x,), label=y, loss_fn=two, run_config=_cfg(4), loss_reduction="mean"
        )
        assert isinstance(got, tuple) and len(got) == 2
        assert_close_rel(got[0], a.detach(), what="loss 0")
        assert_close_rel(got[1], b.detach(), what="loss 1")
        assert_grads_match(rp, ref_grads)
    finally:
        rp.close()


def test_a_batch_normalized_loss_is_not_weighted_again():
    """A loss_fn that already divides by the whole batch's count gives the same under both."""
    model = mlp()
    x, y = _data()
    rows = x.shape[0]

    @batch_normalized
    def share(out, lbl):
        return ((out - lbl) ** 2).sum() / rows

    ref_loss, ref = reference_grads(model, x, y, loss_fn=share)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        for reduction in ("sum", "mean"):
            for p in rp.optim_parameters():
                p.grad = None
            loss = rp.forward_backward(
                (x,), label=y, loss_fn=share, run_config=_cfg(3), loss_reduction=reduction
            )
            assert_close_rel(loss, ref_loss, what=f"loss ({reduction})")
            assert_grads_match(rp, ref)
    finally:
        rp.close()


def test_mean_with_a_grad_scaler_unscales_to_plain_pytorch():
    model = mlp()
    x, y = _data()
    ref_loss, ref = reference_grads(model, x, y, loss_fn=mse)
    scaler = GradScaler(init_scale=1024.0)
    rp = RoundPipe(model, devices="cpu:2", loss_reduction="mean")
    try:
        loss = rp.forward_backward(
            (x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)), run_config=_cfg(3)
        )
        assert_close_rel(loss, ref_loss * 1024.0, what="scaled loss")
        got = {n: p.grad / 1024.0 for n, p in rp.optim_named_parameters()}
        for n in ref:
            assert_close_rel(got[n], ref[n], what=n)
    finally:
        rp.close()


@pytest.mark.parametrize("bad", ["avg", "MEAN", None, 1])
def test_bad_reduction_is_refused_with_its_choices(bad):
    with pytest.raises(ValueError, match="loss_reduction must be 'sum'.*or 'mean'"):
        RoundPipe(mlp(), devices="cpu:1", loss_reduction=bad)
    rp = RoundPipe(mlp(), devices="cpu:1")
    try:
        if bad is not None:
            with pytest.raises(ValueError, match="loss_reduction must be"):
                rp.forward_backward(
                    (torch.randn(2, 8),), loss_fn=lambda o, t: o.sum(), loss_reduction=bad
                )
        rp.loss_reduction = "bogus"
        with pytest.raises(ValueError, match="got 'bogus'"):
            rp.forward_backward((torch.randn(2, 8),), loss_fn=lambda o, t: o.sum())
    finally:
        rp.close()
