"""Preset for ``GPT2LMHeadModel``: learned absolute positions, LayerNorm, tied LM head.

The token embedding ``wte`` is used by the input adapter and (tied) as the LM
head weight by the output adapter: both pipeline layers hold the same
``Parameter``, and the engine sums its two gradients.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .common import (
    CausalLMInputAdapter,
    DecoderBlock,
    build_sequential,
    mask_functions,
    output_adapter,
    prepare_hf_model,
)

__all__ = ["convert_gpt2"]


def convert_gpt2(model: Any) -> nn.Sequential:
    """``GPT2LMHeadModel`` -> ``Sequential(wte + wpe + dropout, GPT2Block..., ln_f + lm_head)``."""
    prepare_hf_model(model)
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError(
            "the GPT-2 preset converts decoder-only GPT-2; this model has cross-attention "
            "(config.add_cross_attention=True). Wrap it with use_sequential_preset=False instead"
        )
    tr = model.transformer
    full_mask, _ = mask_functions(config)
    blocks = [DecoderBlock(block, config, full_mask, rotary=False) for block in tr.h]
    return build_sequential(
        CausalLMInputAdapter(tr.wte, position_embedding=tr.wpe, dropout=tr.drop),
        blocks,
        output_adapter(tr.ln_f, model.lm_head),
    )
