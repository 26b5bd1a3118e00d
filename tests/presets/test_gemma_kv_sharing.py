"""Gemma 3n and Gemma 4 E2B/E4B on the fused path: per-layer inputs, KV sharing (the last
layers read the keys and values an earlier layer stored) and Gemma 3n's AltUp stack travel
in the decoder state, so loss and every gradient equal Hugging Face's own, whatever the
microbatch split (see roundpipe_core/presets/gemma.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import (  # noqa: E402
    RTOL,
    assert_grads_match,
    gemma_kv_sharing_model,
    hf_reference,
    make_batch,
    rel_err,
)

from roundpipe_core import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.presets import GenericDecoderBlock, causal_lm_loss_fn  # noqa: E402


@pytest.mark.parametrize("num_microbatch", [2, 3])
@pytest.mark.parametrize("kind", ["gemma3n", "gemma4"])
def test_fused_forward_backward_matches_hf(kind: str, num_microbatch: int) -> None:
    model = gemma_kv_sharing_model(kind)
    ids, mask, labels = make_batch(padding="left")
    ref_logits, ref_loss, ref_grads = hf_reference(model, ids, mask, labels)
    for name in (
        "embed_tokens_per_layer",
        "per_layer_model_projection",
        "layers.1.self_attn.k_proj",
    ):
        grad = next(g for n, g in ref_grads.items() if name in n)
        assert grad.abs().max() > 0, f"{name}: the test needs a gradient through it"
    rp = wrap_model_to_roundpipe(
        model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch)
    )
    try:
        assert type(rp) is RoundPipe and rp.num_layers == 6
        assert all(isinstance(rp.layers[i], GenericDecoderBlock) for i in range(1, 5))
        loss, out = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
            return_outputs=True,
        )
        assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
        assert rel_err(out.logits, ref_logits) <= RTOL
        assert_grads_match(rp, model, ref_grads, f"{kind}/{num_microbatch}", every_master=True)
        with torch.no_grad():
            logits = rp(input_ids=ids, attention_mask=mask).logits
        assert rel_err(logits, ref_logits) <= RTOL
    finally:
        rp.close()


def test_per_layer_inputs_need_token_ids() -> None:
    rp = wrap_model_to_roundpipe(gemma_kv_sharing_model("gemma4"), devices="cpu:2")
    try:
        with pytest.raises(ValueError, match="per-layer inputs up by token id"):
            rp(inputs_embeds=torch.randn(2, 4, 32))
    finally:
        rp.close()
