"""MoE presets (Qwen3-MoE, GPT-OSS): ``output_router_logits=True`` gives Hugging Face's
router load-balancing loss as ``out.aux_loss`` (and ``coef * aux_loss`` in ``out.loss``),
and it trains: its gradient reaches the router weights, equal to HF's."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import hf_grads, make_batch, make_model, rel_err  # noqa: E402

from roundpipe_core import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.presets import model_output_loss  # noqa: E402

RTOL = 1e-5
ROUTER = {"qwen3_moe": "mlp.gate.weight", "gpt_oss": "mlp.router.weight"}
# 5 pipeline layers; the decoder blocks sit in non-fused backward stages, so they are recomputed
PLAN = ModelExecutePlan(
    fwd_plan=[range(0, 2), range(2, 5)], bwd_plan=[range(4, 5), range(2, 4), range(0, 2)]
)
FUSED_PLAN = ModelExecutePlan(
    fwd_plan=[range(0, 2), range(2, 4)], bwd_plan=[range(4, 5), range(2, 4), range(0, 2)]
)


def assert_grads(rp, model, ref: dict, where: str) -> int:
    routers = 0
    for name, p in model.named_parameters():
        got = rp.master_param(p).grad
        if name not in ref or ref[name].abs().max() == 0:
            assert got is None or got.abs().max() == 0, f"{where}: {name}"
            continue
        assert got is not None, f"{where}: no gradient for {name}"
        err = rel_err(got, ref[name])
        assert err <= RTOL, f"{where}: {name} rel err {err:.2e}"
        routers += name.endswith(ROUTER.get(where.split("/")[0], "?"))
    return routers


@pytest.mark.parametrize("return_logits", [True, False])
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_aux_loss_matches_hf_and_trains_the_router(kind: str, return_logits: bool) -> None:
    model = make_model(kind)
    ids, mask, labels = make_batch(padding="left", seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    ref, ref_grads = hf_grads(model, **kwargs)
    # the load-balancing term alone moves the routers: its gradient is part of what we compare
    aux_only = model(**kwargs).aux_loss
    aux_only.backward()
    assert all(
        p.grad is not None and p.grad.abs().max() > 0
        for n, p in model.named_parameters()
        if n.endswith(ROUTER[kind])
    )
    model.zero_grad(set_to_none=True)
    rp = wrap_model_to_roundpipe(
        model, devices=2, model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=PLAN)
    )
    try:
        out = rp(**kwargs, return_logits=return_logits)
        assert isinstance(out, transformers.modeling_outputs.MoeCausalLMOutputWithPast)
        assert abs(out.aux_loss.item() - ref.aux_loss.item()) <= RTOL * ref.aux_loss.item()
        assert abs(out.loss.item() - ref.loss.item()) <= RTOL * ref.loss.item()
        out.loss.backward()
        routers = assert_grads(rp, model, ref_grads, f"{kind}/return_logits={return_logits}")
        assert routers >= 2, "no router weight was compared"
    finally:
        rp.close()


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_aux_loss_in_forward_backward_and_config_default(kind: str) -> None:
    """Fused forward_backward (one microbatch: the aux loss is a whole-batch statistic) with
    config.output_router_logits=True as the default, as HF reads it."""
    model = make_model(kind, output_router_logits=True)
    ids, mask, labels = make_batch(padding="right", seed=4)
    ref, ref_grads = hf_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert ref.aux_loss is not None
    rp = wrap_model_to_roundpipe(model, devices=3)
    try:
        loss, out = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
            loss_fn=model_output_loss,
            return_outputs=True,
            run_config=RoundPipeRunConfig(num_microbatch=1, execute_plan=FUSED_PLAN),
        )
        assert abs(loss.item() - ref.loss.item()) <= RTOL * ref.loss.item()
        assert abs(out.aux_loss.item() - ref.aux_loss.item()) <= RTOL * ref.aux_loss.item()
        assert assert_grads(rp, model, ref_grads, f"{kind}/fused") >= 2
        with torch.no_grad():  # explicitly off: no aux loss, as HF
            plain = rp(input_ids=ids, labels=labels, output_router_logits=False)
        assert plain.aux_loss is None
    finally:
        rp.close()


def test_qwen3_moe_trains_with_aux_loss_like_hf() -> None:
    """Three SGD steps on loss + coef * aux_loss: the routers (and everything else) end where
    Hugging Face's own training of a copy ends."""
    import copy

    model = make_model("qwen3_moe", router_aux_loss_coef=0.5)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    rp = wrap_model_to_roundpipe(model, devices=2)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.5)
    try:
        for step in range(3):
            ids, mask, labels = make_batch(padding="right", seed=10 + step)
            kwargs = dict(
                input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True
            )
            ref(**kwargs).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            rp.forward_backward(
                input_kwargs=kwargs,
                loss_fn=model_output_loss,
                run_config=RoundPipeRunConfig(num_microbatch=1),
            )
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        rp.synchronize()
        moved = 0
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel_err(p.detach(), q.detach()) <= 1e-5, name
            moved += name.endswith("mlp.gate.weight")
        assert moved == 2
        start = make_model("qwen3_moe")
        assert not torch.equal(
            start.model.layers[0].mlp.gate.weight, model.model.layers[0].mlp.gate.weight
        )
    finally:
        rp.close()
