"""The heart of the suite: RoundPipe computes exactly what plain PyTorch computes."""

from __future__ import annotations

import copy

import pytest
import torch
from _util import assert_close_rel, assert_grads_match, mlp, reference_grads, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

P = ModelExecutePlan


def _data(batch: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("num_microbatch", [1, 2, 3, 4, 5])
def test_forward_backward_matches_pytorch(devices, num_microbatch):
    model = mlp()
    x, y = _data()  # batch 7: uneven splits for 2..5 microbatches
    ref_loss, ref = reference_grads(model, x, y)
    rp = RoundPipe(model, devices=f"cpu:{devices}")
    try:
        loss = rp.forward_backward(
            (x,),
            label=y,
            loss_fn=sum_sq,
            run_config=RoundPipeRunConfig(num_microbatch=num_microbatch),
        )
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref)
    finally:
        rp.close()


FUSED_PLANS = {
    "one_stage": P([], [range(0, 6)]),
    "layer_per_stage": P(
        [range(i, i + 1) for i in range(5)], [range(i, i + 1) for i in reversed(range(6))]
    ),
    "asymmetric": P(
        [range(0, 3), range(3, 5)], [range(5, 6), range(4, 5), range(2, 4), range(0, 2)]
    ),
    "big_fused": P([range(0, 1)], [range(1, 6), range(0, 1)]),
    "fused_then_one": P([range(0, 4)], [range(4, 6), range(0, 4)]),
}


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan_name", sorted(FUSED_PLANS))
def test_fused_plans_and_recompute_grains(plan_name, grain):
    model = mlp()
    x, y = _data()
    ref_loss, ref = reference_grads(model, x, y)
    rp = RoundPipe(model, devices="cpu:3")
    try:
        cfg = RoundPipeRunConfig(
            num_microbatch=3, execute_plan=FUSED_PLANS[plan_name], recompute_grain=grain
        )
        loss = rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref)
    finally:
        rp.close()


TRAIN_PLANS = {
    "one_stage": P([range(0, 6)], [range(0, 6)]),
    "layer_per_stage": P(
        [range(i, i + 1) for i in range(6)], [range(i, i + 1) for i in reversed(range(6))]
    ),
    "asymmetric": P(
        [range(0, 4), range(4, 6)], [range(5, 6), range(3, 5), range(1, 3), range(0, 1)]
    ),
}


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan_name", sorted(TRAIN_PLANS))
def test_autograd_backward_after_forward(plan_name, grain):
    model = mlp()
    x, y = _data()
    x_ref = x.clone().requires_grad_(True)
    ref_model = copy.deepcopy(model)
    ref_loss = sum_sq(ref_model(x_ref), y)
    ref_loss.backward()
    rp = RoundPipe(model, devices="cpu:2")
    try:
        xin = x.clone().requires_grad_(True)
        cfg = RoundPipeRunConfig(
            num_microbatch=4, execute_plan=TRAIN_PLANS[plan_name], recompute_grain=grain
        )
        out = rp(xin, roundpipe_run_config=cfg)
        assert out.requires_grad
        loss = sum_sq(out, y)
        loss.backward()
        assert_close_rel(loss.detach(), ref_loss.detach(), what="loss")
        assert_grads_match(rp, {n: p.grad for n, p in ref_model.named_parameters()})
        assert_close_rel(xin.grad, x_ref.grad, what="input grad")
    finally:
        rp.close()


def test_inference_under_no_grad_matches_and_builds_no_graph():
    model = mlp()
    x, _ = _data(9)
    rp = RoundPipe(model, devices="cpu:3")
    try:
        with torch.no_grad():
            out = rp(x)
            expected = copy.deepcopy(model)(x)
        assert not out.requires_grad
        assert_close_rel(out, expected, what="output")
        assert all(p.grad is None for p in rp.optim_parameters())
        # requires_grad=False forces inference even with grad mode on
        out2 = rp(x, roundpipe_run_config=RoundPipeRunConfig(requires_grad=False))
        assert not out2.requires_grad
        assert_close_rel(out2, expected, what="output")
    finally:
        rp.close()


class _KwargsIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 12)

    def forward(self, x, *, scale, bias=None, tag="unused"):
        assert tag == "keep"  # non-tensors are broadcast to every microbatch
        h = self.lin(x) * scale.unsqueeze(-1)
        return {"h": h if bias is None else h + bias, "mask": scale > 0}


class _DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, d):
        return {"h": torch.tanh(self.lin(d["h"])) * d["mask"].unsqueeze(-1), "mask": d["mask"]}


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 4)
        self.aux = nn.Linear(12, 1)

    def forward(self, d):
        return {"logits": self.lin(d["h"]), "aux": self.aux(d["h"]).squeeze(-1)}


def _dict_model():
    torch.manual_seed(3)
    return nn.Sequential(_KwargsIn(), _DictBlock(), _DictBlock(), _DictOut())


def _dict_loss(out, y):
    return ((out["logits"] - y) ** 2).sum() + out["aux"].pow(2).sum()


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_kwargs_inputs_dict_outputs_and_return_outputs(grain):
    model = _dict_model()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(7, 8, generator=g), torch.randn(7, 4, generator=g)
    scale = torch.tensor([1.0, -1.0, 2.0, 0.5, 1.0, 3.0, -2.0])
    bias = torch.randn(12, generator=g)  # not batch-leading: broadcast
    ref_model = copy.deepcopy(model)
    # RoundPipe passes the call's kwargs to layer 0 (nn.Sequential itself takes none)
    h = ref_model[0](x, scale=scale, bias=bias, tag="keep")
    for layer in ref_model[1:]:
        h = layer(h)
    ref_out = h
    ref_loss = _dict_loss(ref_out, y)
    ref_loss.backward()
    rp = RoundPipe(model, devices="cpu:2")
    try:
        plan = P([range(0, 2)], [range(2, 4), range(0, 2)])
        loss, out = rp.forward_backward(
            input_kwargs={"x": x, "scale": scale, "bias": bias, "tag": "keep"},
            label=y,
            loss_fn=_dict_loss,
            return_outputs=True,
            run_config=RoundPipeRunConfig(
                num_microbatch=3, execute_plan=plan, recompute_grain=grain
            ),
        )
        assert_close_rel(loss, ref_loss.detach(), what="loss")
        assert set(out) == {"logits", "aux"}
        assert_close_rel(out["logits"], ref_out["logits"].detach(), what="logits")
        assert_close_rel(out["aux"], ref_out["aux"].detach(), what="aux")
        assert_grads_match(rp, {n: p.grad for n, p in ref_model.named_parameters()})
    finally:
        rp.close()


class _TiedHead(nn.Module):
    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.emb = emb  # the same module (and Parameter) as layer 0

    def forward(self, h):
        return h @ self.emb.weight.t()


def test_tied_parameters_get_summed_gradients():
    torch.manual_seed(7)
    emb = nn.Embedding(11, 6)
    model = nn.Sequential(
        emb, nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 6), _TiedHead(emb)
    )
    tokens = torch.randint(0, 11, (5, 3))
    target = torch.randn(5, 3, 11)
    ref_loss, ref = reference_grads(model, tokens, target)
    rp = RoundPipe(model, devices="cpu:3")
    try:
        assert len(rp.optim_parameters()) == len(
            list(model.parameters())
        )  # one master for the shared weight
        plan = P([range(0, 2), range(2, 3)], [range(3, 4), range(2, 3), range(0, 2)])
        loss = rp.forward_backward(
            (tokens,),
            label=target,
            loss_fn=sum_sq,
            run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
        )
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, ref)
    finally:
        rp.close()


def test_frozen_parameters_get_no_master_and_no_grad():
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    x, y = _data()
    ref_loss, ref = reference_grads(model, x, y)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        assert rp.master_param(model[0].weight) is None
        names = {n for n, _ in rp.optim_named_parameters()}
        assert "0.weight" not in names and "1.0.weight" in names
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert_grads_match(rp, ref)
    finally:
        rp.close()


def test_gradients_accumulate_over_calls_like_pytorch():
    model = mlp()
    x, y = _data()
    x2, y2 = _data(seed=9)
    ref_model = copy.deepcopy(model)
    (sum_sq(ref_model(x), y) + sum_sq(ref_model(x2), y2)).backward()
    rp = RoundPipe(model, devices="cpu:2")
    try:
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.forward_backward((x2,), label=y2, loss_fn=sum_sq)
        assert_grads_match(rp, {n: p.grad for n, p in ref_model.named_parameters()})
    finally:
        rp.close()
