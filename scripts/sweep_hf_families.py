"""Sweep every causal LM family of the installed transformers through ``wrap_model_to_roundpipe``.

For each entry of transformers' causal-LM auto mapping (``model_type`` ->
``*ForCausalLM`` class), build a tiny fp32 model from its config class (2
layers, hidden size 32, vocabulary 97, dropout 0; nothing is downloaded),
wrap it with the default ``wrap_model_to_roundpipe`` on ``devices="cpu:2"``
and record what happened:

* **converted** (by its preset or by its structure): a ``RoundPipe`` on the
  fused path. The fused ``forward_backward`` (5 rows, the second left-padded
  with labels -100 there, 2 microbatches of 3 and 2 rows) is compared with
  Hugging Face's own ``loss.backward()``: loss and every gradient within
  ``1e-5`` relative is *exact* (relative to the gradient's largest entry, or to
  1e-4 of the model's largest gradient entry where that is larger: a gradient
  that is zero up to rounding, as an attention key bias's, is not judged by
  its own rounding noise).
* **automatic split**: the converter refused; the reason is its ``ValueError``.
  The automatic split (``use_sequential_preset=False``) runs the same batch
  (``rp(input_ids=, attention_mask=, labels=).loss.backward()``, 2
  microbatches) and is compared with Hugging Face the same way.
* **refused**: the converter and the automatic split both refused, each with
  its reason.
* **not decoder-only**: not a text LM trained on ``input_ids`` alone
  (multimodal, encoder-decoder or draft models); the reason says which.
* **skipped**: no tiny model could be built from the config; the reason is the
  error. Where the generic tiny sizes do not make a valid model, a family's
  entry in :data:`FAMILY_CONFIG` sets what it needs (each with why).

Usage::

    python scripts/sweep_hf_families.py             # print the table
    python scripts/sweep_hf_families.py --write     # also write it into docs/presets.md
    python scripts/sweep_hf_families.py llama gemma3  # only these model types

The test suite runs :func:`check_family` on a selection of families
(``tests/presets/test_family_sweep.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

VOCAB = 97
RTOL = 1e-5
MAX_PARAMS = 2_000_000
DOCS = Path(__file__).resolve().parent.parent / "docs" / "presets.md"
BEGIN = "<!-- family-sweep: python scripts/sweep_hf_families.py --write -->"
END = "<!-- /family-sweep -->"

# config attribute -> tiny value (only attributes the default config has are set)
_SIZES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": 64,
    "d_model": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sliding_window": 4,
    "attention_chunk_size": 4,
    "rotary_dim": 4,  # partial rotary (CodeGen, GPT-J): within the head dim 8
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "use_cache": False,
    "is_decoder": True,  # BERT-style and Reformer LM heads run causally only so
    "emb_dim": 32,  # XLM
}


_SET_IF_NONE = ("pad_token_id", "head_dim", "num_key_value_heads")


def _tiny_value(name: str, default: Any) -> Any:
    """The tiny value of one config attribute, or ``default`` to keep it."""
    if name in _SIZES:
        # a None head_dim / kv-head count is one the model would not derive (Ministral)
        keep_none = default is None and name not in _SET_IF_NONE
        return default if keep_none else _SIZES[name]
    if isinstance(default, bool) or default is None:
        return default
    if isinstance(default, float) and any(w in name for w in ("dropout", "pdrop", "jitter")):
        return 0.0
    if not isinstance(default, int):
        return default
    if name.endswith("intermediate_size") or name.endswith("_ffn_dim"):
        return 32
    if name == "qk_head_dim":  # derived: qk_nope_head_dim + qk_rope_head_dim
        return 16
    if name.endswith("head_dim") or "rank" in name:
        return 8
    if "experts_per_tok" in name or name in ("moe_topk", "top_k", "num_selected_experts"):
        return 2
    if name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        return 4
    if name in ("n_shared_experts", "num_shared_experts"):
        return 1
    return default


def _two_layer_types(types: Any) -> list[str] | None:
    """Two layer types with both kinds of a mixed model (``[linear, full]`` for Qwen3-Next)."""
    if not isinstance(types, (list, tuple)) or not types:
        return None
    unique = list(dict.fromkeys(str(t) for t in types))
    return (unique + unique)[:2]


# model type -> (config values on top of the tiny sizes, why the generic sizes do not do)
FAMILY_CONFIG: dict[str, tuple[dict[str, Any], str]] = {
    "bailing_hybrid": (
        {"num_expert_group": 1, "topk_group": 1},
        "its expert groups (8) must divide the tiny expert count",
    ),
    "bamba": (
        {"mamba_n_heads": 8, "mamba_d_state": 16, "attn_layer_indices": [1]},
        "mamba_n_heads must divide mamba_expand * hidden_size; one Mamba and one attention layer",
    ),
    "cohere_compass_text": (
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": None,
            },
        },
        "its rotary parameters are per layer type (None: a layer without rotary)",
    ),
    "cpmant": (
        {"dim_head": 8, "dim_ff": 64, "position_bias_num_buckets": 32, "prompt_length": 4},
        "its sizes have names of their own",
    ),
    "dbrx": (
        {
            "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        },
        "nested attention / FFN configs the generic sizes do not reach; DbrxAttention reads "
        "attn_config.rope_theta, which the config class lacks, and clamps with clip_qkv (8 in "
        "the released checkpoints), which fails when None",
    ),
    "deepseek_v2": ({"num_experts_per_tok": 2}, "its default None reaches topk() as k"),
    "dots1": (
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
        "its defaults (None) build no experts",
    ),
    "dots3_note_text": (
        {
            "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 4,
            "swa_q_lora_rank": 8,
            "swa_kv_lora_rank": 8,
            "swa_head_dim": 16,
            "swa_qk_nope_head_dim": 8,
            "swa_v_head_dim": 8,
        },
        "its sliding-window layers take their own attention sizes (swa_*)",
    ),
    "ernie4_5_moe": ({"moe_k": 2}, "moe_k (6 by default) must not exceed the tiny expert count"),
    "gemma3n_text": (
        {
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": 1,
            "layer_types": ["sliding_attention", "sliding_attention"],
            "activation_sparsity_pattern": [0.95, 0.0],
        },
        "the per-layer-input table is vocabulary-sized; KV sharing needs its layer type among "
        "the layers before the shared ones",
    ),
    "gemma4_text": (
        {
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": 1,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "full_attention"],
            "global_head_dim": 16,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
        },
        "Gemma 4 E2B's per-layer inputs and KV sharing (the last layer reuses the keys and "
        "values of the one before) with 26B-A4B's MoE block and wider global heads with keys "
        "= values, in three layers; the per-layer-input table is vocabulary-sized",
    ),
    "gpt_neo": (
        {"attention_types": [[["global", "local"], 1]], "window_size": 4},
        "attention_types must list one type per layer",
    ),
    "granitemoehybrid": (
        {"mamba_n_heads": 8, "mamba_d_state": 16, "layer_types": ["mamba", "attention"]},
        "mamba_n_heads must divide mamba_expand * hidden_size; one Mamba and one attention layer",
    ),
    "inkling2_loop_text": (
        {"unpadded_vocab_size": VOCAB},
        "its LM head has the unpadded vocabulary size (200058)",
    ),
    "inkling2_text": (
        {"unpadded_vocab_size": VOCAB},
        "its LM head has the unpadded vocabulary size (200058)",
    ),
    "lfm2_moe": (
        {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
        "its layer_types default to None, which the model indexes; one dense and one MoE layer",
    ),
    "longcat_flash": (
        {
            "ffn_hidden_size": 64,
            "expert_ffn_hidden_size": 32,
            "n_routed_experts": 4,
            "zero_expert_num": 2,
        },
        "its expert and zero-expert counts and FFN sizes have names of their own",
    ),
    "mamba2": (
        {"num_heads": 8, "n_groups": 2, "state_size": 16},
        "num_heads * head_dim must equal expand * hidden_size",
    ),
    "plbart": (
        {"decoder_attention_heads": 4, "encoder_attention_heads": 4},
        "its head counts (12, 16) must divide the tiny hidden size",
    ),
    "qwen4_exp_text": (
        {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 8,
            "indexer_budget": 4,
            "indexer_compress_ratio": 2,
        },
        "its indexed-attention layers need the QSA indexer sizes (None by default); no PLE "
        "n-gram tables (ple_layer_ids empty, as by default)",
    ),
    "reformer": (
        {
            "attn_layers": ["local", "lsh"],
            "local_attn_chunk_length": 4,
            "lsh_attn_chunk_length": 4,
            "num_buckets": 2,
            "axial_pos_shape": [2, 4],
            "axial_pos_embds_dim": [16, 16],
            "feed_forward_size": 64,
            "attention_head_size": 8,
        },
        "the axial position embedding's dims must sum to the hidden size and its shape "
        "multiply to the sequence length; chunks within the sweep's 8 tokens",
    ),
    "roc_bert": (
        {
            "pronunciation_embed_dim": 8,
            "pronunciation_vocab_size": 16,
            "shape_embed_dim": 8,
            "shape_vocab_size": 16,
        },
        "its pronunciation and glyph-shape embeddings have sizes of their own",
    ),
    "whisper": (
        {"decoder_attention_heads": 4, "encoder_attention_heads": 4},
        "its head counts (6) must divide the tiny hidden size",
    ),
    "xmod": (
        {"default_language": "en_XX"},
        "its language adapters need a language: the default one, as set_default_language does",
    ),
    "zamba": (
        {"layer_types": ["hybrid", "hybrid"]},
        "the shared transformer block is tied across hybrid layers: two are needed",
    ),
    "zamba2": (
        {"layers_block_type": ["linear_attention", "hybrid"]},
        "its hybrid_layer_ids are derived from layers_block_type, not from layer_types",
    ),
    "zaya": ({"num_experts_per_tok": 1}, "ZAYA supports num_experts_per_tok=1 only"),
}


def tiny_config(config_cls: type, model_type: str | None = None) -> Any:
    """A tiny config of ``config_cls``: its defaults with small sizes, and ``model_type``'s
    entry of :data:`FAMILY_CONFIG` on top."""
    default = config_cls()
    kwargs = {}
    for name, value in vars(default).items():
        if name.startswith("_") or isinstance(getattr(config_cls, name, None), property):
            continue
        tiny = _tiny_value(name, value)
        if tiny is not value:
            kwargs[name] = tiny
    if vars(default).get("kv_lora_rank") and "num_key_value_heads" in kwargs:
        # multi-head latent attention (DeepSeek V2/V3): one key/value head per query head
        kwargs["num_key_value_heads"] = _SIZES["num_attention_heads"]
    kwargs.update(FAMILY_CONFIG.get(model_type or "", ({}, ""))[0])
    layer_types = _two_layer_types(getattr(default, "layer_types", None))
    given = {"layer_types", getattr(config_cls, "attribute_map", {}).get("layer_types")}
    if (
        not given & kwargs.keys()
        and layer_types is not None
        and not isinstance(getattr(config_cls, "layer_types", None), property)
    ):
        try:
            return config_cls(**kwargs, layer_types=layer_types)
        except Exception:  # a config with rules on its layer types: let it derive them
            pass
    return config_cls(**kwargs)


def causal_lm_entries() -> list[tuple[str, str, str]]:
    """``(model_type, config class name, model class name)`` of every causal-LM auto mapping entry."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        config_name = CONFIG_MAPPING_NAMES.get(model_type)
        if isinstance(class_name, (list, tuple)):
            class_name = class_name[0]
        if config_name:
            out.append((model_type, config_name, class_name))
    return out


@dataclasses.dataclass
class FamilyResult:
    model_type: str
    class_name: str
    outcome: (
        str  # "preset", "structure", "automatic split", "refused", "not decoder-only", "skipped"
    )
    reason: str = ""
    exact: bool | None = None
    worst_grad_err: float | None = None
    loss_err: float | None = None
    worst_vs_microbatched: float | None = None  # against HF run over the same microbatches
    seconds: float = 0.0


def make_batch(batch: int = 5, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask (row 1 left-padded by 3) and labels (-100 on padding)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


_SUB_CONFIGS = ("vision_config", "audio_config", "vq_config", "encoder_config", "speech_config")


# causal-LM entries that are no text LM trained on input_ids alone, found by reading their code
_NOT_TEXT_LM = {
    "fuyu": "FuyuForCausalLM feeds image patches into its decoder (a multimodal model); its "
    "text decoder is Persimmon's, judged as persimmon",
    "gemma4_assistant": "a draft model for speculative decoding: every layer attends to the "
    "target model's keys and values (shared_kv_states), which input_ids alone do not give",
    "gemma4_unified_assistant": "a draft model for speculative decoding: every layer attends to "
    "the target model's keys and values (shared_kv_states), which input_ids alone do not give",
    "musicgen": "the entry's config is the text-to-music model's (text encoder, audio encoder, "
    "decoder); MusicgenForCausalLM is its decoder over audio codebooks (num_codebooks rows of "
    "codes per example), not a text LM",
    "musicgen_melody": "the entry's config is the text-to-music model's (text encoder, audio "
    "encoder, decoder); MusicgenMelodyForCausalLM is its decoder over audio codebooks, not a "
    "text LM",
}


def not_decoder_only(model_type: str) -> str | None:
    """Why ``model_type``'s causal-LM class is not a decoder-only text LM, or ``None``."""
    import transformers as tf

    if model_type in _NOT_TEXT_LM:
        return _NOT_TEXT_LM[model_type]

    entry = {m: (c, k) for m, c, k in causal_lm_entries()}[model_type]
    config_cls, class_name = getattr(tf, entry[0]), entry[1]
    if class_name.endswith("ForConditionalGeneration"):
        return f"{class_name} is a multimodal model (it takes image or audio inputs)"
    try:
        default = config_cls()
    except Exception:  # a config that needs arguments: judged by building it
        return None
    subs = [n for n in _SUB_CONFIGS if getattr(default, n, None) is not None]
    twin = [m for m, c, k in causal_lm_entries() if k == class_name and m != model_type]
    if subs and twin:
        return (
            f"this entry's config is the multimodal model's ({', '.join(subs)}); its text "
            f"decoder {class_name} is judged as {', '.join(twin)}"
        )
    if subs:
        what = (
            "a model with a separate encoder"
            if subs == ["encoder_config"]
            else ("a multimodal model (image or audio inputs)")
        )
        return f"its config has {', '.join(subs)}: {what}"
    return None


def build_tiny(model_type: str, seed: int = 0) -> Any:
    """The tiny fp32 model of ``model_type`` in train mode."""
    import transformers as tf

    entry = {m: (c, k) for m, c, k in causal_lm_entries()}[model_type]
    config_cls, model_cls = getattr(tf, entry[0]), getattr(tf, entry[1])
    config = tiny_config(config_cls, model_type)
    with torch.device("meta"):  # count first: a config the sweep cannot shrink stays large
        numel = sum(p.numel() for p in model_cls(config).parameters())
    if numel > MAX_PARAMS:
        raise ValueError(
            f"the tiny config still has {numel / 1e6:.1f} M parameters (sizes the sweep does "
            "not know how to shrink)"
        )
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():  # some inits leave routers at zero: every expert would tie
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.abs().max() == 0:
                p.normal_(0, 0.5)
    model.train()
    return model


ZERO_FLOOR = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """Max error relative to ``b``'s largest entry, or to ``floor`` where that is smaller."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def zero_floor(grads: dict[str, torch.Tensor]) -> float:
    """``ZERO_FLOOR`` times the model's largest gradient entry: a gradient below it is zero
    up to rounding (an attention key bias: softmax ignores a shift of every score), so its
    error is measured against this floor rather than against its own rounding noise."""
    return ZERO_FLOOR * max((g.abs().max().item() for g in grads.values()), default=0.0)


def check_family(model_type: str, num_microbatch: int = 2) -> FamilyResult:
    """Build, wrap and compare one family (see the module docstring)."""
    from roundpipe_core import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
    from roundpipe_core.autosplit import AutoRoundPipe
    from roundpipe_core.presets import causal_lm_loss_fn, convert_decoder_lm, find_preset

    start = time.perf_counter()
    entry = {m: k for m, _, k in causal_lm_entries()}
    result = FamilyResult(model_type, entry[model_type], "skipped")
    reason = not_decoder_only(model_type)
    if reason is not None:
        result.outcome = "not decoder-only"
        result.reason = f"not a decoder-only LM: {reason}"
        result.seconds = time.perf_counter() - start
        return result
    try:
        model = build_tiny(model_type)
    except Exception as exc:  # the sweep reports it
        result.reason = f"no tiny model: {type(exc).__name__}: {_short(exc)}"
        result.seconds = time.perf_counter() - start
        return result
    ids, mask, labels = make_batch()
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    except Exception as exc:
        result.reason = f"the tiny model's own forward fails: {type(exc).__name__}: {_short(exc)}"
        result.seconds = time.perf_counter() - start
        return result
    if find_preset(model) is not None:
        result.outcome = "preset"
    else:
        try:
            convert_decoder_lm(model)
            result.outcome = "structure"
        except Exception as exc:  # ValueError: refused; anything else is reported as a failure
            result.outcome = "automatic split"
            result.reason = _short(exc)
            if not isinstance(exc, ValueError):
                result.reason = f"converter failed: {type(exc).__name__}: {result.reason}"
                result.seconds = time.perf_counter() - start
                return result
    split = result.outcome == "automatic split"
    try:
        out.loss.backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        try:
            rp = wrap_model_to_roundpipe(
                model,
                use_sequential_preset=False if split else None,
                devices="cpu:2",
                model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch),
            )
        except (TypeError, ValueError) as exc:  # the automatic split refuses too
            if not split:
                raise
            result.outcome = "refused"
            result.reason += f"; the automatic split refuses: {_short(exc)}"
            result.seconds = time.perf_counter() - start
            return result
        try:
            assert isinstance(rp, AutoRoundPipe if split else RoundPipe)
            if split:  # no fused path: Hugging Face's loss over the whole batch, then backward
                try:
                    loss = rp(input_ids=ids, attention_mask=mask, labels=labels).loss
                    loss.backward()
                except (TypeError, ValueError) as exc:  # a split module refuses at its call
                    result.outcome = "refused"
                    result.reason += f"; the automatic split refuses: {_short(exc)}"
                    return result
                rp.synchronize()
            else:
                loss = rp.forward_backward(
                    input_kwargs={"input_ids": ids, "attention_mask": mask},
                    label=labels,
                    loss_fn=causal_lm_loss_fn(labels),
                )
            result.loss_err = abs(loss.item() - out.loss.item()) / abs(out.loss.item())
            worst = 0.0
            floor = zero_floor(ref)
            for n, p in model.named_parameters():
                master = rp.master_param(p)
                got = None if master is None else master.grad
                want = ref.get(n)
                if want is None or want.abs().max() == 0:
                    if got is not None and got.abs().max() > 0:
                        worst = float("inf")
                    continue
                worst = max(worst, float("inf") if got is None else rel_err(got, want, floor))
            result.worst_grad_err = worst
            result.exact = worst <= RTOL and result.loss_err <= RTOL
            if not result.exact and result.loss_err <= RTOL and not split:
                # is it summation order? compare with HF's own run over the same microbatches
                rp.synchronize()
                got = {
                    n: rp.master_param(p).grad.clone()
                    for n, p in model.named_parameters()
                    if rp.master_param(p) is not None and rp.master_param(p).grad is not None
                }
                micro = _hf_microbatched_grads(model, ids, mask, labels, num_microbatch)
                result.worst_vs_microbatched = max(
                    (
                        rel_err(got[n], micro[n], zero_floor(micro))
                        for n in got
                        if n in micro and micro[n].abs().max() > 0
                    ),
                    default=0.0,
                )
        finally:
            rp.close()
            result.seconds = time.perf_counter() - start
    except Exception as exc:
        result.exact = False
        result.reason = f"{result.reason}; " if split else ""
        result.reason += f"{type(exc).__name__}: {_short(exc)}"
    result.seconds = time.perf_counter() - start
    return result


def _hf_microbatched_grads(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, num_microbatch: int
) -> dict[str, torch.Tensor]:
    """Hugging Face's gradients summed over the microbatches RoundPipe runs (same losses)."""
    from roundpipe_core.presets import causal_lm_loss_fn

    saved = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fn = causal_lm_loss_fn(labels)
    for rows in torch.arange(ids.shape[0]).chunk(num_microbatch):
        out = model(input_ids=ids[rows], attention_mask=mask[rows])
        fn(out.logits, labels[rows]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        p.grad = saved[n]
    return grads


def _short(exc: BaseException, limit: int = 220) -> str:
    text = " ".join(str(exc).split())
    text = re.sub(r"^\w+ cannot be converted by structure: ", "", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(results: list[FamilyResult]) -> str:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    exact = sum(1 for r in results if r.exact and r.outcome in ("preset", "structure"))
    split_exact = sum(1 for r in results if r.exact and r.outcome == "automatic split")
    order = sum(
        1
        for r in results
        if r.exact is False
        and r.worst_vs_microbatched is not None
        and r.worst_vs_microbatched <= RTOL
    )
    converted = counts.get("preset", 0) + counts.get("structure", 0)
    import transformers

    lines = [
        f"transformers {transformers.__version__}: {len(results)} causal-LM classes; "
        f"**{converted} converted** ({counts.get('preset', 0)} by a preset, "
        f"{counts.get('structure', 0)} by structure), {exact} of them exact against Hugging "
        f"Face's whole-batch gradients and {order} more against its run over the same "
        "microbatches (fp32 summation order); "
        f"{counts.get('automatic split', 0)} automatic split, {split_exact} of them exact "
        "against Hugging Face's own loss and gradients; "
        f"{counts.get('refused', 0)} refused by the converter and the automatic split, each "
        "saying why; "
        f"{counts.get('not decoder-only', 0)} not decoder-only text LMs; "
        f"{counts.get('skipped', 0)} skipped (no tiny model built from the config).",
        "",
        "| model type | class | outcome | exact | worst gradient rel. error | why |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r.model_type):
        exact_s = "" if r.exact is None else ("yes" if r.exact else "**no**")
        if r.exact is False and r.worst_vs_microbatched is not None:
            exact_s = (
                f"summation order: {r.worst_vs_microbatched:.0e} against HF over the same "
                "microbatches"
            )
        err = "" if r.worst_grad_err is None else f"{r.worst_grad_err:.1e}"
        why = r.reason.replace("|", "\\|")
        lines.append(
            f"| {r.model_type} | {r.class_name} | {r.outcome} | {exact_s} | {err} | {why} |"
        )
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{DOCS} lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="only these model types")
    parser.add_argument("--write", action="store_true", help="write the table into docs/presets.md")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    types = args.model_types or [m for m, _, _ in causal_lm_entries()]
    results = []
    for model_type in types:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            r = check_family(model_type)
        results.append(r)
        print(
            f"{r.model_type:28s} {r.outcome:16s} exact={r.exact} err={r.worst_grad_err} "
            f"{r.seconds:.1f}s {r.reason[:100]}",
            file=sys.stderr,
            flush=True,
        )
    text = table(results)
    print(text)
    if args.write:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
