"""Recompute: RNG replay (dropout), save_for_recompute, and buffers written once per forward."""

from __future__ import annotations

import copy

import pytest
import torch
from _util import assert_close_rel, assert_grads_match, sum_sq
from torch import nn

from roundpipe_core import (
    ModelExecutePlan,
    RoundPipe,
    RoundPipeRunConfig,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)
from roundpipe_core.context import current_layer, current_microbatch

# The recording layers below write a shared log dict on purpose (that is how the
# tests observe forward vs recompute); the forward-rule checker rightly warns.
pytestmark = pytest.mark.filterwarnings("ignore:RoundPipe forward rule violated")


class RecordingDropout(nn.Module):
    """Dropout that records its masks: in the forward, in the recompute, or replays given ones."""

    def __init__(self, p: float, log: dict):
        super().__init__()
        self.p = p
        self.log = log  # shared by reference (deepcopy keeps the dict? no: memo below)

    def __deepcopy__(self, memo):
        # replicas must share the log with the original, so copy by hand
        new = RecordingDropout(self.p, self.log)
        new.training = self.training
        return new

    def forward(self, x):
        key = (current_layer(), current_microbatch())
        if "replay" in self.log:
            mask = self.log["replay"][key]
        else:
            mask = (torch.rand_like(x) >= self.p).to(x.dtype) / (1 - self.p)
            self.log.setdefault("recompute" if doing_recompute() else "forward", {}).setdefault(
                key, []
            ).append(mask.cpu())  # logged on the host: the reference model runs on the CPU
        return x * mask


def _dropout_model(log):
    torch.manual_seed(11)
    blocks = [nn.Linear(8, 10)]
    for _ in range(4):
        blocks.append(nn.Sequential(nn.Linear(10, 10), nn.Tanh(), RecordingDropout(0.3, log)))
    blocks.append(nn.Linear(10, 3))
    return nn.Sequential(*blocks)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_dropout_masks_replayed_in_recompute_and_gradients_exact(grain):
    log: dict = {}
    model = _dropout_model(log)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)
    plan = ModelExecutePlan([range(0, 2), range(2, 4)], [range(4, 6), range(2, 4), range(0, 2)])
    rp = RoundPipe(model, devices="cpu:2")
    try:
        cfg = RoundPipeRunConfig(
            num_microbatch=3, execute_plan=plan, recompute_grain=grain, preserve_rng_state=True
        )
        loss = rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
        fwd, rec = log["forward"], log["recompute"]
        # layers 1..3 run in forward stages and are recomputed; every recompute replays the forward mask
        assert set(rec) == {(layer, mb) for layer in (1, 2, 3) for mb in range(3)}
        for key, masks in rec.items():
            for m in masks:
                assert torch.equal(m, fwd[key][0]), (
                    f"recompute of layer/microbatch {key} drew a different mask"
                )
        # gradients equal plain PyTorch run on the same masks, microbatch by microbatch
        ref = copy.deepcopy(model)
        ref_log = {"replay": {k: v[0] for k, v in fwd.items()}}
        for mod in ref.modules():
            if isinstance(mod, RecordingDropout):
                mod.log = ref_log
        ref_loss = torch.zeros(())
        from roundpipe_core import context

        for mb, (xm, ym) in enumerate(zip(x.split(2), y.split(2))):
            h = xm
            for i, layer in enumerate(ref):
                with context.running_layer(i, mb, False, None, torch.device("cpu")):
                    h = layer(h)
            part = sum_sq(h, ym)
            part.backward()
            ref_loss += part.detach()
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, {n: p.grad for n, p in ref.named_parameters()})
    finally:
        rp.close()


def test_without_preserved_rng_recompute_draws_new_masks():
    log: dict = {}
    model = _dropout_model(log)
    x, y = torch.randn(6, 8), torch.randn(6, 3)
    plan = ModelExecutePlan([range(0, 4)], [range(4, 6), range(0, 4)])
    rp = RoundPipe(model, devices="cpu:2")
    try:
        cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, preserve_rng_state=False)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
        diffs = [
            not torch.equal(log["recompute"][k][0], log["forward"][k][0]) for k in log["recompute"]
        ]
        assert any(diffs)
    finally:
        rp.close()


class RandomRouter(nn.Module):
    """Picks one of two experts at random per row (a stand-in for MoE routing)."""

    def __init__(self, log: dict):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.log = log

    def __deepcopy__(self, memo):
        new = RandomRouter.__new__(RandomRouter)
        nn.Module.__init__(new)
        new.experts = copy.deepcopy(self.experts, memo)
        new.log = self.log
        return new

    def forward(self, x):
        if doing_recompute():
            (choice,) = get_recompute_data()
            self.log.setdefault("recompute", []).append((current_microbatch(), choice.cpu()))
        else:
            # a generator outside the RNG RoundPipe replays: only save_for_recompute keeps it
            choice = torch.randint(0, 2, (x.shape[0],), generator=self.log["gen"]).to(x.device)
            save_for_recompute(choice)
            self.log.setdefault("forward", {})[current_microbatch()] = choice.cpu()
        out = torch.stack([self.experts[0](x), self.experts[1](x)], 0)
        return out[choice, torch.arange(x.shape[0])]


def test_save_for_recompute_keeps_routing_for_the_recompute():
    log = {"gen": torch.Generator().manual_seed(0)}
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 6), RandomRouter(log), nn.Tanh(), nn.Linear(6, 2))
    x, y = torch.randn(8, 5), torch.randn(8, 2)
    plan = ModelExecutePlan([range(0, 2)], [range(2, 4), range(0, 2)])
    rp = RoundPipe(model, devices="cpu:2")
    try:
        loss = rp.forward_backward(
            (x,),
            label=y,
            loss_fn=sum_sq,
            run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=plan),
        )
        assert len(log["recompute"]) == 4
        for mb, choice in log["recompute"]:
            assert torch.equal(choice, log["forward"][mb])
        # reference: plain model with the forward's routing
        routing = torch.cat([log["forward"][m] for m in range(4)])
        ref = copy.deepcopy(model)
        h = ref[0](x)
        h = torch.stack([ref[1].experts[0](h), ref[1].experts[1](h)], 0)[routing, torch.arange(8)]
        ref_loss = sum_sq(ref[3](ref[2](h)), y)
        ref_loss.backward()
        assert_close_rel(loss, ref_loss.detach(), what="loss")
        assert_grads_match(rp, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None})
    finally:
        rp.close()


def test_get_recompute_data_outside_recompute_is_an_error():
    with pytest.raises(RuntimeError, match="doing_recompute"):
        get_recompute_data()
    save_for_recompute(torch.ones(1))  # outside RoundPipe: a no-op
    assert not doing_recompute()


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_batchnorm_buffers_updated_once_per_microbatch_forward(grain):
    torch.manual_seed(5)
    # no bias before a BatchNorm: its mean takes the bias out, so the bias's gradient is
    # zero up to rounding and a relative comparison would weigh rounding noise alone
    model = nn.Sequential(
        nn.Linear(4, 6, bias=False),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Linear(6, 6, bias=False),
        nn.BatchNorm1d(6),
        nn.Linear(6, 2),
    )
    x, y = torch.randn(9, 4), torch.randn(9, 2)
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 3), range(3, 5)], [range(5, 6), range(2, 5), range(0, 2)])
    rp = RoundPipe(model, devices="cpu:3")
    try:
        loss = rp.forward_backward(
            (x,),
            label=y,
            loss_fn=sum_sq,
            run_config=RoundPipeRunConfig(
                num_microbatch=3, execute_plan=plan, recompute_grain=grain
            ),
        )
        ref_loss = torch.zeros(())
        for xm, ym in zip(
            x.split(3), y.split(3)
        ):  # the same microbatches, in order, in plain PyTorch
            part = sum_sq(ref(xm), ym)
            part.backward()
            ref_loss += part.detach()
        assert_close_rel(loss, ref_loss, what="loss")
        assert_grads_match(rp, {n: p.grad for n, p in ref.named_parameters()})
        for name in (
            "1.running_mean",
            "1.running_var",
            "4.running_mean",
            "4.running_var",
            "1.num_batches_tracked",
        ):
            got, exp = model.state_dict()[name], ref.state_dict()[name]
            if got.is_floating_point():
                assert_close_rel(got, exp, what=name)
            else:
                assert torch.equal(got, exp), name  # 3 microbatch forwards, not 3 + recomputes
    finally:
        rp.close()


def test_eval_mode_follows_the_host_module():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.9), nn.Linear(6, 2))
    x = torch.randn(5, 4)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        with torch.no_grad():
            rp(x)  # train mode: device copies of the layers are made and cached
            rp.eval()
            assert_close_rel(rp(x), copy.deepcopy(model).eval()(x), what="eval output")
            rp.train()
            model[1].p = 0.0  # plain attributes of the host module reach cached copies too
            assert_close_rel(rp(x), copy.deepcopy(model).eval()(x), what="p=0 output")
    finally:
        rp.close()


def test_dropout_runs_are_reproducible_under_a_seed_whatever_the_thread_timing():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.4)) for _ in range(6)])
    x, y = torch.randn(9, 8), torch.randn(9, 8)
    plan = ModelExecutePlan([range(0, 2), range(2, 4)], [range(4, 6), range(3, 4), range(0, 3)])
    results = []
    for _ in range(3):
        rp = RoundPipe(copy.deepcopy(model), devices="cpu:3")
        try:
            torch.manual_seed(123)
            loss = rp.forward_backward(
                (x,),
                label=y,
                loss_fn=sum_sq,
                run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan),
            )
            results.append((loss, [p.grad.clone() for p in rp.optim_parameters()], torch.rand(1)))
        finally:
            rp.close()
    for loss, grads, after in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))
        assert torch.equal(after, results[0][2])  # the caller's random stream is left as it was
