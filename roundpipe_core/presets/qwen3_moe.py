"""Preset for ``Qwen3MoeForCausalLM``.

The sparse MoE blocks route every token to its top-k experts; each decoder
block replays the forward's routing in the recompute pass (:mod:`.moe`).
``output_router_logits=True`` (argument or ``config.output_router_logits``)
adds Hugging Face's router load-balancing loss: ``out.aux_loss``, and
``router_aux_loss_coef * aux_loss`` in ``out.loss`` when ``labels`` are given;
its gradient reaches the router weights.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .common import convert_rotary_decoder_lm

__all__ = ["convert_qwen3_moe"]


def _routers(layer: Any) -> list[nn.Module]:
    mlp = getattr(layer, "mlp", None)
    gate = getattr(mlp, "gate", None)
    # Dense layers (mlp_only_layers / decoder_sparse_step) have no router.
    if gate is not None and hasattr(mlp, "experts"):
        return [gate]
    return []


def convert_qwen3_moe(model: Any) -> nn.Sequential:
    """``Qwen3MoeForCausalLM`` -> Sequential whose MoE blocks replay routing in recompute."""
    config = model.config
    kind = (
        "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
    )
    return convert_rotary_decoder_lm(
        model, layer_kinds=[kind] * config.num_hidden_layers, router_of=_routers
    )
