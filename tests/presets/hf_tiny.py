"""Tiny random Hugging Face causal LMs built from configs (nothing is downloaded), and the
comparison of a RoundPipe run with Hugging Face's own forward and backward that the preset,
converter and automatic-split tests share."""

from __future__ import annotations

import torch

VOCAB = 97


def make_model(kind: str, seed: int = 0, **overrides):
    """A tiny fp32 model of ``kind`` in train mode with dropout off."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        use_cache=False,
    )
    if kind == "llama":
        cfg = tf.LlamaConfig(**{**common, **overrides})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen3":
        # tied embeddings, like the small Qwen3 checkpoints
        cfg = tf.Qwen3Config(
            **{
                **common,
                "head_dim": 8,
                "use_sliding_window": True,
                "sliding_window": 4,
                "max_window_layers": 1,
                "tie_word_embeddings": True,
                **overrides,
            }
        )
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(
            **{
                **common,
                "use_sliding_window": True,
                "sliding_window": 4,
                "max_window_layers": 2,
                **overrides,
            }
        )
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**{**common, "sliding_window": 5, **overrides})
        model = tf.MistralForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = tf.GPT2Config(
            **{
                "n_embd": 32,
                "n_layer": 3,
                "n_head": 4,
                "n_positions": 64,
                "vocab_size": VOCAB,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "use_cache": False,
                "bos_token_id": 1,
                "eos_token_id": 1,
                **overrides,
            }
        )
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **{
                **common,
                "head_dim": 8,
                "moe_intermediate_size": 16,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [1],
                "norm_topk_prob": True,
                **overrides,
            }
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
        # Router weights start at zero in HF's init: give them values so routing is non-trivial.
        with torch.no_grad():
            for p_name, p in model.named_parameters():
                if p_name.endswith("gate.weight"):
                    p.normal_(0, 0.5)
    elif kind == "gpt_oss":
        cfg = tf.GptOssConfig(
            **{
                **common,
                "intermediate_size": 16,
                "head_dim": 8,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "attention_bias": True,
                "router_aux_loss_coef": 0.02,
                # YaRN as the released model, with a pre-YaRN length consistent with 64 positions
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 2,
                    "rope_theta": 150000.0,
                },
                **overrides,
            }
        )
        cfg._attn_implementation = "eager"  # GPT-OSS has no sdpa path (attention sinks)
        model = tf.GptOssForCausalLM(cfg)
        with torch.no_grad():
            for p_name, p in model.named_parameters():
                if p_name.endswith("router.weight"):
                    p.normal_(0, 0.5)
    else:
        raise ValueError(kind)
    model.train()
    return model


KINDS = ["llama", "qwen3", "qwen2", "mistral", "gpt2", "qwen3_moe", "gpt_oss"]


def make_batch(batch: int = 5, seq: int = 8, padding: str | None = "right", seed: int = 1):
    """input_ids, attention_mask and labels (-100 on padding) with uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padding is not None:
        for b in range(batch):
            n_pad = (b * 3) % (seq - 2)
            if n_pad == 0:
                continue
            if padding == "right":
                mask[b, seq - n_pad :] = 0
            else:
                mask[b, :n_pad] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """Largest absolute difference relative to the largest reference value (or ``floor``)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def zero_floor(grads: dict) -> float:
    """1e-4 of the largest gradient entry: a gradient below it is zero up to rounding (an
    attention key bias), judged against this floor instead of its own rounding noise."""
    return 1e-4 * max((g.abs().max().item() for g in grads.values() if g is not None), default=0)


def hf_reference(model, ids, mask, labels):
    """HF's own forward + backward on the whole batch: (logits, loss, {name: grad or None}),
    the model's gradients cleared after."""
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), out.loss.detach(), grads


def assert_grads_match(
    rp, model, ref_grads: dict, where: str, every_master: bool = False, floor: bool = False
) -> None:
    """Every master gradient of ``rp`` equals ``ref_grads`` (by the model's parameter names)
    within :data:`RTOL`; a parameter HF gives no (or a zero) gradient gets none from RoundPipe
    either (an expert no token was routed to). ``every_master``: every parameter must have a
    master copy; ``floor``: gradients zero up to rounding are judged by :func:`zero_floor`."""
    checked = 0
    low = zero_floor(ref_grads) if floor else 1e-30
    for name, p in model.named_parameters():
        master = rp.master_param(p)
        if every_master:
            assert master is not None, f"{where}: no master copy for trainable {name}"
        got = None if master is None else master.grad
        want = ref_grads.get(name)
        if want is None or want.abs().max() == 0:
            assert got is None or got.abs().max() == 0, f"{where}: {name} got a gradient, HF none"
            continue
        assert got is not None, f"{where}: no gradient for {name}"
        err = rel_err(got, want, low)
        assert err <= RTOL, f"{where}: gradient of {name} differs, rel err {err:.3e}"
        checked += 1
    assert checked > 0


def assert_fused_and_inference_match_hf(
    rp, model, ids, mask, labels, reference, where: str, **grads_match
) -> None:
    """``rp.forward_backward`` with HF's loss: loss, logits and every master gradient equal
    ``reference`` (:func:`hf_reference`'s) within :data:`RTOL`, and so do the logits of an
    inference call. ``grads_match``: :func:`assert_grads_match`'s options."""
    from roundpipe_core.presets import causal_lm_loss_fn

    ref_logits, ref_loss, ref_grads = reference
    loss, out = rp.forward_backward(
        input_kwargs={"input_ids": ids, "attention_mask": mask},
        label=labels,
        loss_fn=causal_lm_loss_fn(labels),
        return_outputs=True,
    )
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert rel_err(out.logits, ref_logits) <= RTOL
    assert_grads_match(rp, model, ref_grads, where, **grads_match)
    with torch.no_grad():
        logits = rp(input_ids=ids, attention_mask=mask).logits
    assert rel_err(logits, ref_logits) <= RTOL


def hf_grads(model, **kwargs):
    """Hugging Face's own forward + backward: (output, {name: grad}), grads cleared after."""
    out = model(**kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def gemma_kv_sharing_model(kind: str, seed: int = 0):
    """A tiny Gemma 3n (AltUp) or Gemma 4 E2B-shaped model (``kind`` "gemma3n" / "gemma4"):
    per-layer inputs, the last two of four layers reusing the keys and values of the two
    before them (one sliding, one full), every parameter moved off its initial value so that
    no gradient path is zero (Gemma 3n's AltUp output scale starts at zero)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        sliding_window=4,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        pad_token_id=0,
        use_cache=False,
    )
    if kind == "gemma3n":
        cfg = tf.Gemma3nTextConfig(
            **common,
            laurel_rank=4,
            altup_num_inputs=3,
            activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        )
        model = tf.Gemma3nForCausalLM(cfg)
    else:  # Gemma 4 E2B: wider global heads, a wider MLP in the sharing layers, soft-capping
        cfg = tf.Gemma4TextConfig(
            **common, global_head_dim=16, use_double_wide_mlp=True, final_logit_softcapping=30.0
        )
        model = tf.Gemma4ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.train()
