"""Preset for ``Qwen2ForCausalLM``: Llama layout with optional sliding-window layers."""

from __future__ import annotations

from typing import Any

from torch import nn

from .common import convert_rotary_decoder_lm

__all__ = ["convert_qwen2"]


def convert_qwen2(model: Any) -> nn.Sequential:
    """``Qwen2ForCausalLM`` -> Sequential; each block builds the mask of its layer type."""
    return convert_rotary_decoder_lm(model, layer_kinds=list(model.config.layer_types))
