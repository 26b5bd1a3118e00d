"""The converter by structure: families without a preset are fused, pipelined RoundPipes
whose loss, logits and every gradient equal Hugging Face's own, and what it cannot
convert is refused with a ValueError naming the feature (then the automatic split).

The families are chosen for the ways they differ from Llama: Gemma 2 (logit soft-capping,
embedding scale, sliding + full layers, tied embeddings), Gemma 3 (two rotary tables, one
per layer type), Cohere (logit_scale, tied), Granite (embedding multiplier, logits
divided), Falcon (``transformer.h`` / ``ln_f`` layout, fused QKV), Qwen3-Next (linear
attention layers with a 2D mask, MoE), Jamba (Mamba mixers reading their conv weight
directly), OPT (a learned position embedding called with the padding mask, default
position ids counted over the padding mask, a backbone wrapping its decoder); Mixtral and
Qwen2-MoE for the routers (replay, load-balancing loss). Tiny models come from ``scripts/sweep_hf_families.py`` (nothing downloaded).
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import hf_tiny  # noqa: E402
from hf_tiny import RTOL, assert_fused_and_inference_match_hf, hf_reference, rel_err  # noqa: E402
from hf_tiny import assert_grads_match as _assert_grads_match  # noqa: E402
from sweep_hf_families import build_tiny, make_batch  # noqa: E402

from roundpipe_core import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.presets import (  # noqa: E402
    GenericDecoderBlock,
    NoPresetError,
    causal_lm_loss_fn,
    convert_decoder_lm,
)
from roundpipe_core.presets.probe import check_conversion  # noqa: E402
from roundpipe_core.presets.structure import find_decoder_parts  # noqa: E402

# (model type, microbatches): 5 rows split 3+2, 2+2+1 or 1 each
FAMILIES = [
    ("gemma2", 2),
    ("gemma3_text", 3),
    ("cohere", 5),
    ("granite", 2),
    ("falcon", 3),
    ("qwen3_next", 2),
    ("jamba", 2),
    ("opt", 3),
]


def assert_grads_match(rp, model, ref, where: str) -> None:
    # OPT's attention key biases: a gradient that is zero up to rounding
    _assert_grads_match(rp, model, ref, where, floor=True)


@pytest.mark.parametrize(("model_type", "num_microbatch"), FAMILIES)
def test_fused_forward_backward_and_inference_match_hf(
    model_type: str, num_microbatch: int
) -> None:
    model = build_tiny(model_type)
    ids, mask, labels = make_batch()  # 5 rows, row 1 left-padded with labels -100 there
    reference = hf_reference(model, ids, mask, labels)
    rp = wrap_model_to_roundpipe(
        model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch)
    )
    try:
        assert type(rp) is RoundPipe
        layers = model.config.get_text_config().num_hidden_layers
        assert rp.num_layers == layers + 2
        assert all(isinstance(rp.layers[i], GenericDecoderBlock) for i in range(1, layers + 1))
        if model.config.get_text_config().tie_word_embeddings:
            assert rp.layers[0].embed_tokens.weight is rp.layers[-1].lm_head.weight
        # OPT's attention key biases: a gradient that is zero up to rounding
        assert_fused_and_inference_match_hf(
            rp, model, ids, mask, labels, reference, model_type, floor=True
        )
    finally:
        rp.close()


def test_autograd_forward_with_labels_matches_hf() -> None:
    """``rp(..., labels=...).loss.backward()`` on a family with two rotary tables."""
    model = build_tiny("gemma3_text")
    ids, mask, labels = make_batch()
    ref_logits, ref_loss, ref_grads = hf_reference(model, ids, mask, labels)
    rp = wrap_model_to_roundpipe(
        model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    try:
        assert len(rp.layers[0].position_calls) == 2  # local and global rotary tables
        out = rp(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(out.loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
        out.loss.backward()
        assert_grads_match(rp, model, ref_grads, "gemma3/autograd")
    finally:
        rp.close()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_moe_router_loss_and_replay_match_hf(model_type: str) -> None:
    """MoE families without a preset: the routers HF records router_logits from are found,
    their top-k choice is replayed in the recompute, and with output_router_logits the
    load-balancing loss (and its gradient into the routers) is HF's over 2 microbatches."""
    model = build_tiny(model_type)
    model.config.output_router_logits = True
    ids, mask, labels = make_batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.aux_loss is not None
    out.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    rp = wrap_model_to_roundpipe(
        model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    try:
        assert all(rp.layers[i].num_routers == 1 for i in range(1, rp.num_layers - 1))
        got = rp(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(got.aux_loss.item() - out.aux_loss.item()) <= RTOL * out.aux_loss.item()
        assert abs(got.loss.item() - out.loss.item()) <= RTOL * out.loss.item()
        got.loss.backward()
        assert_grads_match(rp, model, ref, f"{model_type}/aux")
        assert any(".gate." in n or n.endswith("gate.weight") for n in ref)  # routers trained
    finally:
        rp.close()


def test_soft_capped_logits_refuse_the_chunked_loss() -> None:
    model = build_tiny("gemma2")
    seq = convert_decoder_lm(model)
    assert seq[-1].logit_ops == (("softcap", model.config.final_logit_softcapping),)
    ids, mask, labels = make_batch()
    state = seq[0](input_ids=ids, attention_mask=mask, labels=labels, return_logits=False)
    for layer in list(seq)[1:-1]:
        state = layer(*state)
    with pytest.raises(ValueError, match="soft-caps"):
        seq[-1](*state)


def test_check_conversion_catches_a_wrong_layer() -> None:
    """The probe's final check compares the built layers with the model: drop Gemma 2's
    soft-capping, or hand Gemma 3's layers each other's rotary table, and it refuses."""
    model = build_tiny("gemma2")
    seq = convert_decoder_lm(model)
    parts = find_decoder_parts(model)
    check_conversion(parts, seq)
    seq[-1].logit_ops = ()
    with pytest.raises(ValueError, match="logits differ"):
        check_conversion(parts, seq)
    model = build_tiny("gemma3_text")
    seq = convert_decoder_lm(model)
    parts = find_decoder_parts(model)
    adapter = seq[0]
    adapter.position_calls = tuple(reversed(adapter.position_calls))
    with pytest.raises(ValueError, match="differ"):
        check_conversion(parts, seq)


def _opt_with_layerdrop():
    model = build_tiny("opt")
    model.config.layerdrop = 0.1
    return model


def _minimax_m2_with_router_loss():
    model = build_tiny("minimax_m2")  # its router also takes a score-correction bias
    model.config.output_router_logits = True
    return model


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: build_tiny("bloom"), "ALiBi"),
        (lambda: build_tiny("recurrent_gemma"), "decoding cache"),
        (lambda: build_tiny("mpt"), "ALiBi bias of \\(heads, 1, max_seq_len\\)"),
        (_opt_with_layerdrop, "config.layerdrop=0.1"),
        (_minimax_m2_with_router_loss, "output_router_logits=True"),
    ],
    ids=[
        "bloom",
        "recurrent_gemma",
        "mpt",
        "opt-layerdrop",
        "minimax-m2-aux",
    ],
)
def test_refused_with_the_reason(make, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        convert_decoder_lm(make())


def test_refusal_falls_back_to_the_automatic_split_and_says_why(caplog) -> None:
    model = build_tiny("bloom")
    with caplog.at_level(logging.INFO, logger="roundpipe_core.presets"):
        rp = wrap_model_to_roundpipe(model, devices=1)
    try:
        assert "BloomForCausalLM gets the automatic split" in caplog.text
        assert "ALiBi" in caplog.text
        assert not any(isinstance(m, GenericDecoderBlock) for m in getattr(rp, "layers", []))
    finally:
        rp.close()
    with pytest.raises(NoPresetError, match="ALiBi") as info:
        wrap_model_to_roundpipe(build_tiny("bloom"), use_sequential_preset=True, devices=1)
    assert str(info.value).count("cannot be converted by structure") == 1  # said once


def test_generic_family_with_lora_matches_peft() -> None:
    """peft LoRA on a Llama-like family without a preset (OLMo 2)."""
    peft = pytest.importorskip("peft")
    model = build_tiny("olmo2")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids, mask, labels = make_batch()
    out = pm(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ref = {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}
    pm.zero_grad(set_to_none=True)
    rp = wrap_model_to_roundpipe(
        pm, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    try:
        assert isinstance(rp.layers[1], GenericDecoderBlock)
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )
        assert abs(loss.item() - out.loss.item()) <= RTOL * out.loss.item()
        for n, p in pm.named_parameters():
            master = rp.master_param(p)
            if not p.requires_grad:
                assert master is None, f"frozen {n} got a master copy"
                continue
            assert rel_err(master.grad, ref[n]) <= RTOL, n
    finally:
        rp.close()


@pytest.mark.parametrize(
    "model_type", ["gemma3_text", "qwen3_next", "jamba", "gemma3n_text", "gemma4_text"]
)
def test_generic_blocks_follow_the_forward_rules(model_type: str) -> None:
    """Every layer of a converted model runs under check_forward_rules without a warning
    (no writes to plain attributes, parameters or shared buffers in forward)."""
    import warnings

    from roundpipe_core.checks import check_forward_rules, find_shared_buffers
    from roundpipe_core.context import RecomputeStore, running_layer

    seq = convert_decoder_lm(build_tiny(model_type))
    layers = list(seq)
    shared = find_shared_buffers(layers)
    ids, mask, labels = make_batch()
    store = RecomputeStore()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with running_layer(0, 0, False, store, torch.device("cpu")):
            x = check_forward_rules(
                0,
                layers[0],
                lambda: layers[0](input_ids=ids, attention_mask=mask, labels=labels),
                shared[0],
            )
        for i in range(1, len(layers)):
            with running_layer(i, 0, False, store, torch.device("cpu")):
                x = check_forward_rules(i, layers[i], lambda: layers[i](x), shared[i])  # noqa: B023
    assert [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)] == []


@pytest.mark.parametrize(
    ("model_type", "attr", "dropout"),
    [("gpt_bigcode", "drop", 0.1), ("biogpt", "dropout", 0.2), ("opt", None, None)],
)
def test_embedding_dropout_is_read_from_a_training_forward(model_type, attr, dropout) -> None:
    """The probe runs in eval mode, so a dropout on the embeddings (an ``nn.Dropout`` child:
    GPT-BigCode; a functional one with the backbone's rate: BioGPT) is read from a
    training-mode forward up to the first layer, and the input adapter applies it; OPT's
    ``config.dropout`` acts inside its layers only, so it gets none."""
    model = build_tiny(model_type)
    model.config.dropout = 0.3  # OPT: inside the layers (the converter must not add it)
    backbone = find_decoder_parts(model).backbone
    if attr == "drop":
        backbone.drop.p = dropout
    elif attr is not None:
        setattr(backbone, attr, dropout)
    seq = convert_decoder_lm(model)
    got = seq[0].dropout
    assert (got.p if got is not None else None) == dropout
    if got is not None:
        assert got.training == backbone.training


def test_mask_builders_spelled_as_in_older_transformers_are_called_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers 5.17's mask builders name their cache parameter ``past_key_values``
    (the pinned release: ``cache``): the converter calls either spelling, and Qwen3 (full
    and sliding-window layers, sdpa) still converts and matches HF. Without it, every
    candidate mask raised and the probe refused Qwen3 (seen on the GPU machine's 5.17)."""
    from transformers import masking_utils

    # built first: the model's module binds the real builders when it is imported
    model = hf_tiny.make_model("qwen3")
    assert len(set(model.config.layer_types)) == 2  # full and sliding: both builders
    ids, mask, labels = hf_tiny.make_batch(padding="left")
    reference = hf_reference(model, ids, mask, labels)
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        real = getattr(masking_utils, name)

        def older(config, inputs_embeds, attention_mask, past_key_values, *, _real=real, **kw):
            return _real(
                config=config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=past_key_values,
                **kw,
            )

        monkeypatch.setattr(masking_utils, name, older)
    rp = wrap_model_to_roundpipe(
        model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    try:
        assert type(rp) is RoundPipe
        assert_fused_and_inference_match_hf(rp, model, ids, mask, labels, reference, "qwen3")
    finally:
        rp.close()
