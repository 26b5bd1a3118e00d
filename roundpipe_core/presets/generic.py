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

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .common import (
    CausalLMInputAdapter,
    build_sequential,
    call_layer,
    output_adapter,
    prepare_hf_model,
    split_call,
)
from .moe import (
    Rescore,
    install_router_replay,
    rescore_softmax_then_topk,
    rescore_softmax_topk_renormalised,
    rescore_topk_then_softmax,
)
from .probe import (
    MASK_BUILDERS,
    PROBE_SEED,
    LayerRecipe,
    ModelRecipe,
    check_conversion,
    eval_mode,
    probe_decoder,
)
from .state import DecoderState, unpack_state
from .structure import DecoderParts, find_decoder_parts

__all__ = ["GenericDecoderBlock", "convert_decoder_lm"]


_RESCORES: tuple[Rescore, ...] = (
    rescore_softmax_then_topk,
    rescore_softmax_topk_renormalised,
    rescore_topk_then_softmax,
)


def _router_class(model: nn.Module) -> type | None:
    """The router class Hugging Face records ``router_logits`` from (``_can_record_outputs``)."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    return target if isinstance(target, type) and issubclass(target, nn.Module) else None


def _find_routers(parts: DecoderParts) -> tuple[list[list[nn.Module]], Rescore | None, int | None]:
    """Per layer the routers, how they weigh their experts, and the expert count.

    A router must return ``(router_logits, scores, indices)`` and weigh its chosen
    experts as one of ``_RESCORES`` does (tried on random hidden states); else
    ``([], None, None)``: no routing replay and no load-balancing loss.
    """
    cls = _router_class(parts.model) or _router_class(parts.backbone)
    if cls is None:
        return [[] for _ in parts.layers], None, None
    per_layer = [[m for m in layer.modules() if isinstance(m, cls)] for layer in parts.layers]
    first = next((r for rs in per_layer for r in rs), None)
    hidden = getattr(parts.config, "hidden_size", None)
    weight = next(first.parameters(), None) if first is not None else None
    if first is None or weight is None or not isinstance(hidden, int):
        return [[] for _ in parts.layers], None, None
    g = torch.Generator().manual_seed(PROBE_SEED)
    x = torch.randn(1, 6, hidden, generator=g).to(device=weight.device, dtype=weight.dtype)
    try:
        with torch.no_grad():
            out = first(x)
    except Exception:  # a router that takes more than the hidden states (a bias, a mask)
        return [[] for _ in parts.layers], None, None
    if not (
        isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)
    ):
        return [[] for _ in parts.layers], None, None
    logits, scores, indices = out
    for rescore in _RESCORES:
        try:
            with torch.no_grad():
                got = rescore(first, logits, indices)
        except Exception:  # indices of another layout than (tokens, k)
            continue
        if got.shape == scores.shape and torch.allclose(
            got.float(), scores.float(), rtol=1e-5, atol=1e-6
        ):
            return per_layer, rescore, int(logits.shape[-1])
    return [[] for _ in parts.layers], None, None


class GenericDecoderBlock(nn.Module):
    """One decoder layer as one pipeline layer, called as the recorded forward called it.

    Args:
        layer: the Hugging Face decoder layer (shared, not copied).
        config: the model's (text) config (read only).
        recipe: the layer's keywords and where each comes from (:class:`.probe.LayerRecipe`).
        routers: MoE routers inside the layer (with :func:`.moe.install_router_replay`):
            their choice is replayed in the recompute, and with ``output_router_logits``
            their statistics are added to the state for the load-balancing loss.
    """

    def __init__(
        self,
        layer: nn.Module,
        config: Any,
        recipe: LayerRecipe,
        routers: Sequence[nn.Module] = (),
    ) -> None:
        super().__init__()
        from transformers import masking_utils

        self.layer = layer
        self.num_routers = len(routers)
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
        kwargs: dict[str | int, Any] = {}
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
            elif source == "fresh":
                kwargs[key] = detail()
            else:  # "mask": rebuilt here from the 2D padding mask (see .state)
                kind, with_pos, skip = detail
                mask_kwargs: dict[str, Any] = {
                    "config": self.config,
                    "inputs_embeds": hidden,
                    "attention_mask": attention_mask,
                    "cache": None,
                }
                if not skip:
                    mask_kwargs["allow_is_causal_skip"] = False
                if with_pos:
                    mask_kwargs["position_ids"] = position_ids
                kwargs[key] = self.mask_fns[kind](**mask_kwargs)
        args, named = split_call(kwargs)
        out, extras = call_layer(
            lambda: self.layer(hidden, *args, **named),
            self.num_routers,
            extras,
            attention_mask,
            hidden,
        )
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
    prepare_hf_model(model)
    with eval_mode(model):
        routers, rescore, num_experts = _find_routers(parts)
        if rescore is None and getattr(parts.config, "output_router_logits", False):
            raise ValueError(
                f"{type(model).__name__} cannot be converted by structure: it adds the router "
                "load-balancing loss (config.output_router_logits=True), and its routers are not "
                "ones the converter can read (returning router_logits, scores and indices, "
                "weighing experts as a known rescore function does); set "
                "config.output_router_logits = False, or register a preset with router_of= "
                "(see docs/add-a-preset.md)"
            )
        recipe = probe_decoder(parts)
        seq = _build(parts, recipe, routers, rescore, num_experts)
        check_conversion(parts, seq)
    dropout = seq[0].dropout
    if recipe.embed_dropout is not None and isinstance(dropout, nn.Module):
        dropout.train(parts.backbone.training)  # a module of its own: trains as the backbone
    return seq


def _build(
    parts: DecoderParts,
    recipe: ModelRecipe,
    routers: list[list[nn.Module]],
    rescore: Rescore | None,
    num_experts: int | None,
) -> nn.Sequential:
    """``Sequential(input adapter, GenericDecoderBlock..., output adapter)`` of the model's modules."""
    moe = rescore is not None and num_experts is not None
    if rescore is not None and num_experts is not None:
        for layer_routers in routers:
            for router in layer_routers:
                install_router_replay(router, rescore)
    tables = [
        (parts.position_modules[name], layer_type) for name, layer_type in recipe.position_tables
    ]
    position_embedding = (
        None
        if recipe.position_embedding is None
        else parts.other_modules[recipe.position_embedding]
    )
    blocks = [
        GenericDecoderBlock(layer, parts.config, r, rs if moe else ())
        for layer, r, rs in zip(parts.layers, recipe.layers, routers)
    ]
    config = parts.config
    return build_sequential(
        CausalLMInputAdapter(
            parts.embed_tokens,
            embed_scale=recipe.embed_scale,
            embed_scale_as_tensor=recipe.embed_scale_as_tensor,
            position_tables=tables,
            position_embedding=position_embedding,
            position_embedding_inputs=recipe.position_embedding_inputs,
            positions_from_mask=recipe.positions_from_mask,
            dropout=None if recipe.embed_dropout is None else nn.Dropout(recipe.embed_dropout),
            router_logits_default=bool(getattr(config, "output_router_logits", False))
            if moe
            else None,
        ),
        blocks,
        output_adapter(
            parts.other_modules[recipe.norm_name],
            parts.lm_head,
            num_experts=num_experts if moe else None,
            router_aux_loss_coef=float(getattr(parts.model, "router_aux_loss_coef", 0.0) or 0.0)
            if moe
            else 0.0,
            logit_ops=recipe.logit_ops,
        ),
    )
