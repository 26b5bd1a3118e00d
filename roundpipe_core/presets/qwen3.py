"""Preset for ``Qwen3ForCausalLM``: Llama layout plus q/k norms (inside the layers) and
optional sliding-window layers (``config.layer_types``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .common import convert_rotary_decoder_lm

__all__ = ["convert_qwen3"]


def convert_qwen3(model: Any) -> nn.Sequential:
    """``Qwen3ForCausalLM`` -> Sequential; each block builds the mask of its layer type."""
    return convert_rotary_decoder_lm(model, layer_kinds=list(model.config.layer_types))
