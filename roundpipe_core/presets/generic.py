"""The converter by structure: any decoder-only causal LM built the way transformers builds them.

:func:`convert_decoder_lm` finds the parts (:mod:`.structure`), reads how the backbone
calls them (:mod:`.probe`), builds the Sequential from the model's own modules
(:mod:`.common`, :mod:`.head`) and checks it against the model. See docs/presets.md.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .common import CausalLMInputAdapter, GenericDecoderBlock
from .gemma import AltUpMerge, AltUpStack, PerLayerInputs, altup_projections
from .moe import (
    Rescore,
    install_router_replay,
    rescore_softmax_then_topk,
    rescore_softmax_topk_renormalised,
    rescore_topk_then_softmax,
)
from .probe import PROBE_SEED, ModelRecipe, check_conversion, eval_mode, probe_decoder, refuse
from .structure import DecoderParts, find_decoder_parts

__all__ = ["convert_decoder_lm"]


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
    none: tuple[list[list[nn.Module]], None, None] = ([[] for _ in parts.layers], None, None)
    cls = _router_class(parts.model) or _router_class(parts.backbone)
    if cls is None:
        return none
    per_layer = [[m for m in layer.modules() if isinstance(m, cls)] for layer in parts.layers]
    first = next((r for rs in per_layer for r in rs), None)
    hidden = getattr(parts.config, "hidden_size", None)
    weight = next(first.parameters(), None) if first is not None else None
    if first is None or weight is None or not isinstance(hidden, int):
        return none
    g = torch.Generator().manual_seed(PROBE_SEED)
    x = torch.randn(1, 6, hidden, generator=g).to(device=weight.device, dtype=weight.dtype)
    try:
        out = first(x)
    except Exception:  # a router that takes more than the hidden states (a bias, a mask)
        return none
    if not (
        isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)
    ):
        return none
    logits, scores, indices = out
    for rescore in _RESCORES:
        try:
            got = rescore(first, logits, indices)
        except Exception:  # indices of another layout than (tokens, k)
            continue
        if got.shape == scores.shape and torch.allclose(
            got.float(), scores.float(), rtol=1e-5, atol=1e-6
        ):
            return per_layer, rescore, int(logits.shape[-1])
    return none


def _prepare(model: Any) -> None:
    """Turn Hugging Face gradient checkpointing off, with a warning: RoundPipe already
    recomputes every stage, checkpointing on top would run it twice."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers < 5
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        warnings.warn(
            "Hugging Face gradient checkpointing is turned off for RoundPipe, which recomputes "
            "activations itself",
            RuntimeWarning,
            stacklevel=4,
        )
        disable = getattr(model, "activation_checkpointing_disable", None)
        (disable or model.gradient_checkpointing_disable)()


def convert_decoder_lm(model: Any) -> nn.Sequential:
    """Convert a decoder-only Hugging Face causal LM by its structure.

    Args:
        model: a ``*ForCausalLM`` module (peft-unwrapped).

    Returns:
        ``Sequential(CausalLMInputAdapter, GenericDecoderBlock..., CausalLMOutputAdapter)``.

    Raises:
        ValueError: naming the part or feature that cannot be converted exactly.
    """
    from .head import CausalLMOutputAdapter  # needs transformers, an optional dependency

    parts = find_decoder_parts(model)
    _prepare(model)
    config = parts.config
    with eval_mode(model), torch.no_grad():  # the probe reads the model, trains nothing
        routers, rescore, num_experts = _find_routers(parts)
        moe = rescore is not None
        if not moe and getattr(config, "output_router_logits", False):
            raise refuse(
                parts,
                "it adds the router load-balancing loss (config.output_router_logits=True), and "
                "its routers are not ones the converter can read (returning router_logits, "
                "scores and indices, weighing experts as a known rescore function does); set "
                "config.output_router_logits = False, or register a preset of your own "
                "(see docs/add-a-preset.md)",
            )
        recipe = probe_decoder(parts)
        norm = parts.other_modules[recipe.norm_name]
        altup = altup_projections(parts.backbone)
        for router in (r for rs in routers for r in rs):
            assert rescore is not None
            install_router_replay(router, rescore)
        seq = nn.Sequential(
            _input_adapter(parts, recipe, moe),
            *(
                GenericDecoderBlock(layer, config, r, rs)
                for layer, r, rs in zip(parts.layers, recipe.layers, routers)
            ),
            CausalLMOutputAdapter(
                norm if altup is None else AltUpMerge(altup[1], norm),
                parts.lm_head,
                num_experts=num_experts,
                router_aux_loss_coef=float(getattr(model, "router_aux_loss_coef", 0.0) or 0.0),
                logit_ops=recipe.logit_ops,
            ),
        )
        check_conversion(parts, seq)
    dropout = seq[0].dropout
    if isinstance(dropout, nn.Module):
        dropout.train(parts.backbone.training)  # a module of its own: trains as the backbone
    return seq


def _input_adapter(parts: DecoderParts, recipe: ModelRecipe, moe: bool) -> CausalLMInputAdapter:
    pos = recipe.position_embedding
    takes = [any(e[1] == "per_layer_input" for e in r.inputs) for r in recipe.layers]
    per_layer = all(takes)  # each takes the first of those left: all or none do
    if any(takes) and not per_layer:
        raise refuse(parts, "only some of its layers take per-layer inputs")
    altup = altup_projections(parts.backbone) if recipe.layers[0].stacked else None
    return CausalLMInputAdapter(
        parts.embed_tokens,
        position_tables=[(parts.position_modules[n], t) for n, t in recipe.position_tables],
        position_embedding=None if pos is None else parts.other_modules[pos],
        position_embedding_inputs=recipe.position_embedding_inputs,
        positions_from_mask=recipe.positions_from_mask,
        dropout=None if recipe.embed_dropout is None else nn.Dropout(recipe.embed_dropout),
        router_logits_default=bool(getattr(parts.config, "output_router_logits", False))
        if moe
        else None,
        embed_scale=recipe.embed_scale,
        embed_scale_as_tensor=recipe.embed_scale_as_tensor,
        per_layer_inputs=PerLayerInputs(parts.backbone) if per_layer else None,
        stack=None if altup is None else AltUpStack(altup[0]),
    )
