"""Preset for ``LlamaForCausalLM`` (and Llama-shaped models with the same module layout)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .common import convert_rotary_decoder_lm

__all__ = ["convert_llama"]


def convert_llama(model: Any) -> nn.Sequential:
    """``LlamaForCausalLM`` -> ``Sequential(input adapter, decoder layers..., norm + lm_head)``.

    All layers use full causal attention.
    """
    return convert_rotary_decoder_lm(model)
