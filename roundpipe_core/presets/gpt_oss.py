"""Preset for ``GptOssForCausalLM``: alternating sliding/full attention with sinks, MoE MLPs.

Every decoder layer's MLP is a top-k MoE whose router weighs the chosen
experts by a softmax over *their* logits only; the recompute pass replays the
forward's choice and recomputes those weights the same way (:mod:`.moe`).
Attention sinks live inside the attention modules, which are reused as they
are. ``output_router_logits=True`` adds the router load-balancing loss
(``out.aux_loss``) as for Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .common import convert_rotary_decoder_lm
from .moe import rescore_topk_then_softmax

__all__ = ["convert_gpt_oss"]


def _routers(layer: Any) -> list[nn.Module]:
    return [layer.mlp.router]


def convert_gpt_oss(model: Any) -> nn.Sequential:
    """``GptOssForCausalLM`` -> Sequential; each block builds the mask of its layer type."""
    return convert_rotary_decoder_lm(
        model,
        layer_kinds=list(model.config.layer_types),
        router_of=_routers,
        rescore=rescore_topk_then_softmax,
        # GPT-OSS builds its masks without position_ids (no packed-sequence detection)
        mask_with_position_ids=False,
    )
