"""Gemma 3n and Gemma 4 E2B/E4B on the fused path: per-layer inputs, KV sharing (the last
layers read the keys and values an earlier layer stored) and Gemma 3n's AltUp stack travel
in the decoder state, so loss and every gradient equal Hugging Face's own, whatever the
microbatch split (see roundpipe_core/presets/gemma.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import (  # noqa: E402
    assert_fused_and_inference_match_hf,
    gemma_kv_sharing_model,
    hf_reference,
    make_batch,
)

from roundpipe_core import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.presets import GenericDecoderBlock  # noqa: E402


@pytest.mark.parametrize("num_microbatch", [2, 3])
@pytest.mark.parametrize("kind", ["gemma3n", "gemma4"])
def test_fused_forward_backward_matches_hf(kind: str, num_microbatch: int) -> None:
    model = gemma_kv_sharing_model(kind)
    ids, mask, labels = make_batch(padding="left")
    reference = hf_reference(model, ids, mask, labels)
    ref_grads = reference[2]
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
        assert_fused_and_inference_match_hf(
            rp, model, ids, mask, labels, reference, f"{kind}/{num_microbatch}", every_master=True
        )
    finally:
        rp.close()


def test_per_layer_inputs_need_token_ids() -> None:
    rp = wrap_model_to_roundpipe(gemma_kv_sharing_model("gemma4"), devices="cpu:2")
    try:
        with pytest.raises(ValueError, match="per-layer inputs up by token id"):
            rp(inputs_embeds=torch.randn(2, 4, 32))
    finally:
        rp.close()
