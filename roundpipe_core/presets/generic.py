"""The converter by structure: any decoder-only causal LM built the way transformers builds them.

``convert_decoder_lm(model)`` finds the parts (:mod:`.structure`), reads how
the backbone calls them from one recorded forward (:mod:`.probe`), builds::

    Sequential(input adapter, one GenericDecoderBlock per decoder layer, output adapter)

from the model's own modules (parameters shared, tied embeddings stay one
``Parameter``), and checks the result against the model on the probe batch
(logits and loss, the whole batch and each row alone), with the model in eval
mode (dropout off) and its training flags restored afterwards. Whatever it cannot rebuild exactly raises ``ValueError``
naming the part; :func:`~roundpipe_core.presets.wrap_model_to_roundpipe` then
logs the reason and uses the automatic split.

The built-in presets (:mod:`.llama` and friends) stay as they are: they build
the same layout without the probe.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .common import CausalLMInputAdapter, build_sequential, output_adapter, prepare_hf_model
from .probe import (
    MASK_BUILDERS,
    LayerRecipe,
    ModelRecipe,
    check_conversion,
    eval_mode,
    probe_decoder,
)
from .state import DecoderState, unpack_state
from .structure import DecoderParts, find_decoder_parts

__all__ = ["GenericDecoderBlock", "convert_decoder_lm"]


def _refuse_router_loss(model: nn.Module, config: Any) -> None:
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{type(model).__name__} cannot be converted by structure: it adds the router "
            "load-balancing loss (config.output_router_logits=True), which the generic converter "
            "does not carry; set config.output_router_logits = False, or register a preset "
            "with router_of= (see docs/add-a-preset.md)"
        )


class GenericDecoderBlock(nn.Module):
    """One decoder layer as one pipeline layer, called as the recorded forward called it.

    Args:
        layer: the Hugging Face decoder layer (shared, not copied).
        config: the model's (text) config (read only).
        recipe: the layer's keywords and where each comes from (:class:`.probe.LayerRecipe`).
    """

    def __init__(self, layer: nn.Module, config: Any, recipe: LayerRecipe) -> None:
        super().__init__()
        from transformers import masking_utils

        self.layer = layer
        # Plain (read-only) attributes: never written in forward.
        self.config = config
        self.recipe = recipe
        self.mask_fns = {
            kind: getattr(masking_utils, name)
            for kind, name in MASK_BUILDERS.items()
            if hasattr(masking_utils, name)
        }

    def forward(self, *state: Any) -> DecoderState:
        hidden, tables, sin, position_ids, attention_mask, labels, extras = unpack_state(state)
        kwargs: dict[str, Any] = {}
        for key, source, detail in self.recipe.inputs:
            if source == "const":
                kwargs[key] = detail
            elif source == "padding_mask":
                kwargs[key] = attention_mask
            elif source == "position_ids":
                kwargs[key] = position_ids
            elif source == "cache_position":
                kwargs[key] = torch.arange(hidden.shape[1], device=hidden.device)
            elif source == "table":
                kwargs[key] = tables[detail]
            else:  # "mask": rebuilt here from the 2D padding mask (see .state)
                kind, with_pos = detail
                mask_kwargs: dict[str, Any] = {
                    "config": self.config,
                    "inputs_embeds": hidden,
                    "attention_mask": attention_mask,
                    "cache": None,
                }
                if with_pos:
                    mask_kwargs["position_ids"] = position_ids
                kwargs[key] = self.mask_fns[kind](**mask_kwargs)
        out = self.layer(hidden, **kwargs)
        if self.recipe.tuple_output:
            out = out[0]
        return (out, tables, sin, position_ids, attention_mask, labels, extras)


def convert_decoder_lm(model: Any) -> nn.Sequential:
    """Convert a decoder-only Hugging Face causal LM by its structure.

    Args:
        model: a ``*ForCausalLM`` module (peft-unwrapped).

    Returns:
        ``Sequential(input adapter, GenericDecoderBlock..., output adapter)``.

    Raises:
        ValueError: naming the part or feature that cannot be converted exactly.
    """
    parts = find_decoder_parts(model)
    _refuse_router_loss(model, parts.config)
    prepare_hf_model(model)
    with eval_mode(model):
        recipe = probe_decoder(parts)
        seq = _build(parts, recipe)
        check_conversion(parts, seq)
    return seq


def _build(parts: DecoderParts, recipe: ModelRecipe) -> nn.Sequential:
    """``Sequential(input adapter, GenericDecoderBlock..., output adapter)`` of the model's modules."""
    tables = [
        (parts.position_modules[name], layer_type) for name, layer_type in recipe.position_tables
    ]
    blocks = [
        GenericDecoderBlock(layer, parts.config, r) for layer, r in zip(parts.layers, recipe.layers)
    ]
    return build_sequential(
        CausalLMInputAdapter(
            parts.embed_tokens,
            embed_scale=recipe.embed_scale,
            embed_scale_as_tensor=recipe.embed_scale_as_tensor,
            position_tables=tables,
        ),
        blocks,
        output_adapter(
            parts.other_modules[recipe.norm_name], parts.lm_head, logit_ops=recipe.logit_ops
        ),
    )
