"""Every preset: the RoundPipe run of the converted model is the Hugging Face model.

For a tiny random fp32 model of each preset, logits, loss and the gradient of
every parameter from RoundPipe (fused ``forward_backward`` and the autograd
``forward`` + ``loss.backward()`` path) equal the Hugging Face model's own
forward/backward within 1e-5 relative, with left and right padding, on 1..3
CPU devices under several plans (asymmetric ones included).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import (  # noqa: E402
    KINDS,
    RTOL,
    hf_reference,
    make_batch,
    make_model,
    rel_err,
)
from hf_tiny import assert_grads_match as _assert_grads_match  # noqa: E402

from roundpipe_core import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.presets import causal_lm_loss, causal_lm_loss_fn  # noqa: E402

# 5 pipeline layers: input adapter, 3 decoder blocks, output adapter.
FUSED_SETUPS = {
    "1dev-default": dict(devices=1, num_microbatch=2, plan=None),
    "2dev-asym": dict(
        devices=2,
        num_microbatch=3,
        plan=ModelExecutePlan(
            fwd_plan=[range(0, 2), range(2, 3)], bwd_plan=[range(3, 5), range(1, 3), range(0, 1)]
        ),
    ),
    "3dev-fine": dict(
        devices=3,
        num_microbatch=5,
        plan=ModelExecutePlan(
            fwd_plan=[range(0, 1), range(1, 2), range(2, 4)],
            bwd_plan=[range(4, 5), range(2, 4), range(1, 2), range(0, 1)],
        ),
    ),
    "2dev-all-fused": dict(
        devices=2, num_microbatch=4, plan=ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, 5)])
    ),
}


def assert_grads_match(rp, model, ref_grads, where: str) -> None:
    _assert_grads_match(rp, model, ref_grads, where, every_master=True)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_backward_matches_hf(kind: str, padding: str, pool_devices) -> None:
    model = make_model(kind)
    ids, mask, labels = make_batch(padding=padding)
    ref_logits, ref_loss, ref_grads = hf_reference(model, ids, mask, labels)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for setup_name, setup in FUSED_SETUPS.items():
        where = f"{kind}/{padding}/{setup_name}"
        # on CPU workers the masters are the model's own parameters (shared by default):
        # the last setup's gradients are on them, as after a plain backward
        model.zero_grad(set_to_none=True)
        rp = wrap_model_to_roundpipe(
            model,
            devices=pool_devices(setup["devices"]),
            model_run_config=RoundPipeRunConfig(
                num_microbatch=setup["num_microbatch"], execute_plan=setup["plan"]
            ),
        )
        try:
            assert rp.num_layers == 5 and rp.num_devices == setup["devices"]
            if kind in ("qwen3", "gpt2"):  # tied: one Parameter in the first and last layer
                assert rp.layers[0].embed_tokens.weight is rp.layers[-1].lm_head.weight
            loss, out = rp.forward_backward(
                input_kwargs={"input_ids": ids, "attention_mask": mask},
                label=labels,
                loss_fn=causal_lm_loss_fn(labels),
                return_outputs=True,
            )
            assert rel_err(out.logits, ref_logits) <= RTOL, f"{where}: logits differ"
            assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item()), (
                f"{where}: loss"
            )
            assert_grads_match(rp, model, ref_grads, where)
        finally:
            rp.close()
    # no step was taken: the Hugging Face weights are untouched
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("kind", KINDS)
def test_autograd_forward_with_labels_matches_hf(kind: str, grain: str) -> None:
    """``rp(input_ids=..., labels=...)`` returns HF's loss; ``.loss.backward()`` gives HF's grads."""
    model = make_model(kind)
    ids, mask, labels = make_batch(padding="left", seed=3)
    ref_logits, ref_loss, ref_grads = hf_reference(model, ids, mask, labels)
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 3), range(3, 5)], bwd_plan=[range(4, 5), range(1, 4), range(0, 1)]
    )
    rp = wrap_model_to_roundpipe(
        model,
        devices=2,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=3, execute_plan=plan, recompute_grain=grain
        ),
    )
    try:
        out = rp(input_ids=ids, attention_mask=mask, labels=labels)
        assert rel_err(out.logits, ref_logits) <= RTOL
        assert abs(out.loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
        out.loss.backward()
        assert_grads_match(rp, model, ref_grads, f"{kind}/autograd/{grain}")
    finally:
        rp.close()


def test_inference_and_position_ids() -> None:
    """No-grad pipelined inference returns HF's logits; explicit position ids (1,S) / (B,S) work."""
    model = make_model("llama")
    ids, mask, _ = make_batch(padding="right")
    pos = torch.arange(ids.shape[1]).unsqueeze(0) + 3
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        ref_plain = model(input_ids=ids).logits
    rp = wrap_model_to_roundpipe(model, devices=2)
    try:
        assert rp.vocab_size == model.vocab_size == 97 and rp.config is model.config
        with torch.no_grad():
            got = rp(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            got_b = rp(
                input_ids=ids, attention_mask=mask, position_ids=pos.expand(ids.shape[0], -1)
            ).logits
            got_plain = rp(ids).logits
            got_last = rp(ids, logits_to_keep=2).logits
            embeds = model.get_input_embeddings()(ids)
            got_embeds = rp(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).logits
        assert rel_err(got_embeds, ref) <= RTOL
        assert rel_err(got, ref) <= RTOL
        assert rel_err(got_b, ref) <= RTOL
        assert rel_err(got_plain, ref_plain) <= RTOL
        assert got_last.shape[1] == 2 and rel_err(got_last, ref_plain[:, -2:]) <= RTOL
    finally:
        rp.close()


def test_plain_loss_is_mean_per_microbatch() -> None:
    """Documented behaviour: ``causal_lm_loss`` as loss_fn sums per-microbatch means."""
    model = make_model("llama")
    ids, mask, labels = make_batch(padding="right")
    rp = wrap_model_to_roundpipe(
        model, devices=1, model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    try:
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss,
        )
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        expect = causal_lm_loss(logits[:3], labels[:3]) + causal_lm_loss(logits[3:], labels[3:])
        assert abs(loss.item() - expect.item()) <= RTOL * expect.item()
    finally:
        rp.close()


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_causal_lm_loss_fn_is_hf_loss_under_both_reductions(loss_reduction: str) -> None:
    """causal_lm_loss_fn divides by the whole batch's token count (batch-normalised):
    "mean" must not weight its microbatch losses by rows a second time."""
    model = make_model("llama")
    ids, mask, labels = make_batch(padding="right")
    _, ref_loss, ref_grads = hf_reference(model, ids, mask, labels)
    rp = wrap_model_to_roundpipe(
        model, devices=2, model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    try:
        rp.loss_reduction = loss_reduction
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )
        assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
        assert_grads_match(rp, model, ref_grads, f"causal_lm_loss_fn/{loss_reduction}")
    finally:
        rp.close()
