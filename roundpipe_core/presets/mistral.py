"""Preset for ``MistralForCausalLM``: Llama layout; every layer uses the sliding window
when ``config.sliding_window`` is set (as ``MistralModel`` does)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .common import convert_rotary_decoder_lm

__all__ = ["convert_mistral"]


def convert_mistral(model: Any) -> nn.Sequential:
    """``MistralForCausalLM`` -> Sequential."""
    config = model.config
    kind = "full_attention" if config.sliding_window is None else "sliding_attention"
    return convert_rotary_decoder_lm(model, layer_kinds=[kind] * config.num_hidden_layers)
