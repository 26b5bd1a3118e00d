"""Preset for ``Qwen3MoeForCausalLM``.

The sparse MoE blocks route every token to its top-k experts. The recompute
pass of the backward must use the *same* experts as the forward, or the
backward differentiates a different network: routing can change between the
two passes when kernels are non-deterministic or scores tie. Each decoder
block therefore records the router's choice with ``save_for_recompute`` and
the recompute replays it (``get_recompute_data``); the routing *weights* are
recomputed from the router logits so their gradient still flows.

The auxiliary load-balancing loss (``config.output_router_logits=True``) is
not computed by the converted model.
"""

from __future__ import annotations

import warnings

from torch import nn

from .common import convert_rotary_decoder_lm


def _routers(layer: nn.Module) -> list[nn.Module]:
    mlp = getattr(layer, "mlp", None)
    gate = getattr(mlp, "gate", None)
    # Dense layers (mlp_only_layers / decoder_sparse_step) have no router.
    if gate is not None and hasattr(mlp, "experts"):
        return [gate]
    return []


def convert_qwen3_moe(model: nn.Module) -> nn.Sequential:
    """``Qwen3MoeForCausalLM`` -> Sequential whose MoE blocks replay routing in recompute."""
    config = model.config
    if getattr(config, "output_router_logits", False):
        warnings.warn(
            "the RoundPipe Qwen3-MoE preset does not add the router auxiliary loss "
            "(config.output_router_logits=True); add it to your loss yourself if you need it",
            RuntimeWarning,
            stacklevel=3,
        )
    kind = (
        "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
    )
    return convert_rotary_decoder_lm(
        model, layer_kinds=[kind] * config.num_hidden_layers, router_of=_routers
    )
