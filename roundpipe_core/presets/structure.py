"""Find the parts of a decoder-only causal LM by its structure, not by its class name.

How the parts are called, :mod:`.probe` reads. Nothing here imports ``transformers``.
See docs/presets.md, "the converter by structure".
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .gemma import GEMMA_PARTS

__all__ = ["DecoderParts", "find_decoder_parts"]


@dataclasses.dataclass(frozen=True)
class DecoderParts:
    """The parts of a decoder-only causal LM, all the model's own modules (shared, not copied).

    Attributes:
        model: the ``*ForCausalLM`` module.
        config: its (text) config.
        backbone: ``model.base_model``, whose forward runs embedding, layers and norm.
        embed_tokens: the token embedding (``backbone.get_input_embeddings()``).
        layers: the decoder layers, in order.
        lm_head: the LM head (``model.get_output_embeddings()``).
        position_modules: backbone children that compute position tables (rotary
            embeddings: no parameters), by attribute name.
        other_modules: the remaining backbone children with weights or a norm class,
            by attribute name; the final norm is one of them, a learned or sinusoidal
            position embedding may be another (which, the probe finds).
    """

    model: nn.Module
    config: Any
    backbone: nn.Module
    embed_tokens: nn.Module
    layers: tuple[nn.Module, ...]
    lm_head: nn.Module
    position_modules: dict[str, nn.Module]
    other_modules: dict[str, nn.Module]


def _has_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _call_getter(module: nn.Module, getter: str) -> Any:
    """``module.getter()``, or ``None`` where it is missing or fails (as for models whose
    embeddings transformers cannot find by itself)."""
    fn = getattr(module, getter, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except (NotImplementedError, AttributeError, TypeError):
        return None


def _unsupported_feature(config: Any, backbone: nn.Module) -> str | None:
    """A known feature that cannot be cut into pipeline layers, named, or ``None``."""
    if getattr(config, "alibi", False) or callable(getattr(backbone, "build_alibi_tensor", None)):
        return (
            "it adds an ALiBi bias whose first dim is batch x heads, not batch, so it cannot be "
            "split into microbatches between pipeline layers"
        )
    if callable(getattr(backbone, "build_mpt_alibi_tensor", None)):
        return (
            "it adds an ALiBi bias of (heads, 1, max_seq_len) with no batch dim, which cannot "
            "travel in the decoder state split into microbatches, and its layers take a "
            "boolean 4D mask the converter does not rebuild"
        )
    layerdrop = getattr(config, "layerdrop", 0.0)
    if isinstance(layerdrop, float) and layerdrop > 0:
        return (
            f"it skips whole layers at random in training (config.layerdrop={layerdrop}), which "
            "a pipeline of fixed layers does not; set config.layerdrop = 0.0 to convert"
        )
    rescale = getattr(config, "rescale_every", 0)
    if isinstance(rescale, int) and rescale > 0:
        return (
            "it rescales its layers' weights in place when it switches between training and "
            f"inference (config.rescale_every={rescale}), a write to parameters in forward; set "
            "config.rescale_every = 0 to convert"
        )
    if callable(getattr(backbone, "_setup_cache", None)):
        return "its layers need a decoding cache in training (recurrent state set up by the model)"
    return None


def _inner_decoder(backbone: nn.Module) -> nn.Module:
    """The module that holds the embedding and layers: ``backbone`` itself, or its only child
    with weights when the backbone just wraps a decoder (OPT's ``model.decoder``)."""
    embed = _call_getter(backbone, "get_input_embeddings")
    if embed is not None and any(embed is c for c in backbone.children()):
        return backbone
    weighted = [c for c in backbone.children() if _has_weights(c)]
    if len(weighted) == 1 and _call_getter(weighted[0], "get_input_embeddings") is not None:
        return weighted[0]
    return backbone


def find_decoder_parts(model: nn.Module) -> DecoderParts:
    """Find embedding, decoder layers, head and the backbone's other parts of ``model``, a
    Hugging Face decoder-only causal LM (``*ForCausalLM``); ValueError naming what is
    missing or cannot be placed (then the automatic split is the way to run the model)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"{name} has no .config: not a Hugging Face model; convert it to an nn.Sequential "
            "yourself or use the automatic split"
        )
    config = _call_getter(config, "get_text_config") or config
    if getattr(config, "is_encoder_decoder", False) or getattr(
        model.config, "is_encoder_decoder", False
    ):
        raise ValueError(f"{name} is an encoder-decoder model, not a decoder-only causal LM")
    lm_head = _call_getter(model, "get_output_embeddings")
    if not isinstance(lm_head, nn.Module):
        raise ValueError(f"{name} has no LM head (get_output_embeddings() returned {lm_head!r})")
    backbone = getattr(model, "base_model", None)
    if backbone is model:  # a base_model_prefix that names no child (Llama 4's text model)
        backbone = getattr(model, "model", None)
    if not isinstance(backbone, nn.Module) or backbone is model:
        raise ValueError(
            f"{name} has no backbone module (base_model_prefix "
            f"{getattr(model, 'base_model_prefix', None)!r}) holding embedding and layers"
        )
    feature = _unsupported_feature(config, backbone)
    if feature is not None:
        raise ValueError(f"{name} cannot be converted by structure: {feature}")
    for child_name, child in model.named_children():
        if child is backbone or child is lm_head or not _has_weights(child):
            continue
        raise ValueError(
            f"{name} has a part besides its backbone and LM head: {child_name} "
            f"({type(child).__name__}), which the generic converter does not place"
        )
    backbone = _inner_decoder(backbone)
    embed = _call_getter(backbone, "get_input_embeddings")
    children = dict(backbone.named_children())
    if embed is None or not any(embed is c for c in children.values()):
        raise ValueError(
            f"{name}: the token embedding is not a direct part of the backbone "
            f"{type(backbone).__name__}"
        )
    num_layers = getattr(config, "num_hidden_layers", None)
    fewer = getattr(config, "num_layers", None)
    if isinstance(num_layers, int) and isinstance(fewer, int) and fewer < num_layers:
        # LongCat-Flash counts two attention sublayers per decoder layer in num_hidden_layers
        if not any(
            isinstance(c, nn.ModuleList) and len(c) >= num_layers for c in children.values()
        ):
            num_layers = fewer
    lists = [
        c
        for n, c in children.items()
        if isinstance(c, nn.ModuleList)
        and n not in GEMMA_PARTS  # Gemma 3n's AltUp projections, one per stacked input
        and len(c) > 0
        and (num_layers is None or len(c) >= num_layers)
    ]
    if len(lists) != 1:
        found = ", ".join(
            f"{n} ({len(c)})" for n, c in children.items() if isinstance(c, nn.ModuleList)
        )
        raise ValueError(
            f"{name}: expected one list of {num_layers} decoder layers in "
            f"{type(backbone).__name__}, found {found or 'none'}"
        )
    layer_list = lists[0]
    layers = tuple(layer_list[:num_layers])  # num_layers None: all
    position_modules: dict[str, nn.Module] = {}
    other_modules: dict[str, nn.Module] = {}
    for child_name, child in children.items():
        if child is embed or child is layer_list:
            continue
        label = f"{child_name} {type(child).__name__}".lower()
        if any(w in label for w in ("rotary", "rope")) and next(child.parameters(), None) is None:
            # a rotary-style table: its buffers are tables recomputed from the config
            position_modules[child_name] = child
        elif isinstance(child, nn.Dropout):
            continue  # an embedding dropout: the probe finds it in a training-mode forward
        elif _has_weights(child) or "norm" in type(child).__name__.lower():
            # a final norm may have no weights (OLMo's non-parametric LayerNorm)
            other_modules[child_name] = child
    return DecoderParts(
        model=model,
        config=config,
        backbone=backbone,
        embed_tokens=embed,
        layers=layers,
        lm_head=lm_head,
        position_modules=position_modules,
        other_modules=other_modules,
    )
