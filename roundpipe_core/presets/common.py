"""The pipeline layers of a converted causal LM, and the *decoder state* they pass on.

A converted model is ``nn.Sequential(CausalLMInputAdapter, GenericDecoderBlock...,
CausalLMOutputAdapter)`` (the last in :mod:`.head`), made of the Hugging Face model's own
modules. The decoder state is a plain tuple ``(hidden_states, tables, position_ids,
attention_mask, labels, extras)``, every tensor batch-first so that the engine splits it
into microbatches along dim 0. ``tables`` holds the position tables (rotary cos/sin)
computed once in layer 0; ``extras`` is a dict of call options and running sums:
``return_logits``, ``logits_to_keep``, ``num_items_in_batch`` (0-dim tensor or ``None``),
``output_router_logits`` and ``router_stats`` (:mod:`.moe`). The 4D attention mask does not
travel (for long sequences it is larger than the hidden states): each block rebuilds it
from the 2D padding mask with Hugging Face's own mask functions. See docs/presets.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..kinds import check_flag
from .moe import add_router_stats, run_with_router_replay
from .probe import LayerRecipe, build_mask

__all__ = ["STATE_FIELDS", "CausalLMInputAdapter", "GenericDecoderBlock", "unpack_state"]

DecoderState = tuple[Any, ...]
STATE_FIELDS = ("hidden_states", "tables", "position_ids", "attention_mask", "labels", "extras")


def unpack_state(state: tuple[Any, ...]) -> DecoderState:
    """Accept the decoder state either splatted (``layer(*state)``) or as one tuple."""
    if len(state) == 1 and isinstance(state[0], (tuple, list)):
        state = tuple(state[0])
    if len(state) != len(STATE_FIELDS):
        raise TypeError(
            f"a preset layer expects the decoder state {STATE_FIELDS} from the previous layer, "
            f"got {len(state)} values; run the layers of a converted model in order"
        )
    return state


class CausalLMInputAdapter(nn.Module):
    """Layer 0 of a converted causal LM: embeddings, position ids, position tables, call options.

    Args:
        embed_tokens: the model's token embedding (shared, not copied).
        position_tables: the position-embedding calls of the model's layers (rotary
            embeddings; Gemma 3's local and global ones), as ``(module, layer_type or
            None)`` pairs, each computed once, ``module(hidden, position_ids[,
            layer_type])``; the state's ``tables`` holds their outputs in this order.
        position_embedding: a learned or sinusoidal position embedding added to the
            embeddings (GPT-2's ``wpe``, OPT's ``embed_positions``), or ``None``.
        position_embedding_inputs: how ``position_embedding`` is called, as
            :class:`.probe.LayerRecipe` inputs with sources ``"const"``, ``"padding_mask"``
            and ``"position_ids"``; default: ``position_embedding(position_ids)``.
        positions_from_mask: default position ids counted over the padding mask,
            ``cumsum(mask) * mask - 1`` (OPT), instead of ``0..S-1``.
        dropout: embedding dropout, or ``None``.
        router_logits_default: MoE models: ``config.output_router_logits`` (the
            default of ``output_router_logits``); ``None`` for dense models,
            which do not take the argument.
        embed_scale: multiply the embeddings (also given ``inputs_embeds``) by this
            (Gemma's ``hidden_size ** 0.5``, Granite's ``embedding_multiplier``), or ``None``.
        embed_scale_as_tensor: multiply by a tensor of the embeddings' dtype (as
            Gemma-style code writes it) instead of a Python float; the two round
            differently in half precision.
        per_layer_inputs: ``module(input_ids, embeddings)`` giving the per-layer inputs
            ``extras["per_layer_inputs"]`` (Gemma 3n/4, :class:`.gemma.PerLayerInputs`), or
            ``None``.
        stack: ``module(embeddings)`` giving the hidden states the layers take (Gemma 3n's
            AltUp stack, :class:`.gemma.AltUpStack`), or ``None``.
    """

    def __init__(
        self,
        embed_tokens: nn.Module,
        position_tables: Sequence[tuple[nn.Module, str | None]] = (),
        position_embedding: nn.Module | None = None,
        position_embedding_inputs: Sequence[tuple[str | int, str, Any]] = (
            (0, "position_ids", None),
        ),
        positions_from_mask: bool = False,
        dropout: nn.Module | None = None,
        router_logits_default: bool | None = None,
        embed_scale: float | None = None,
        embed_scale_as_tensor: bool = False,
        per_layer_inputs: nn.Module | None = None,
        stack: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.per_layer_inputs = per_layer_inputs
        self.stack = stack
        self.embed_tokens = embed_tokens
        self.position_embedding = position_embedding
        self.position_embedding_inputs = tuple(position_embedding_inputs)
        self.positions_from_mask = positions_from_mask
        self.dropout = dropout
        self.router_logits_default = router_logits_default
        self.embed_scale = embed_scale
        self.embed_scale_as_tensor = embed_scale_as_tensor
        modules: list[nn.Module] = []
        calls = []
        for module, layer_type in position_tables:
            index = next((i for i, m in enumerate(modules) if m is module), len(modules))
            if index == len(modules):
                modules.append(module)
            calls.append((index, () if layer_type is None else (layer_type,)))
        self.position_modules = nn.ModuleList(modules)
        self.position_calls = tuple(calls)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_logits: bool = True,
        output_router_logits: bool | None = None,
        logits_to_keep: int = 0,
        **unsupported: Any,
    ) -> DecoderState:
        """Embed the tokens and build the decoder state.

        Args:
            input_ids / inputs_embeds: exactly one of them.
            attention_mask: ``(B, S)`` padding mask.
            position_ids: ``(B, S)`` or ``(1, S)``; default ``0..S-1``.
            labels: ``(B, S)`` token ids (shifted inside), ``-100`` where no loss.
            num_items_in_batch: loss denominator (see :mod:`.head`).
            return_logits: ``False`` (with ``labels``): no logits; the loss is
                computed in token chunks from the hidden states and the LM-head weight.
            output_router_logits: MoE models: compute ``aux_loss``.
            logits_to_keep: ``k > 0``: logits of the last ``k`` positions only
                (inference; with ``labels`` the loss needs every position).
        """
        unsupported = {k: v for k, v in unsupported.items() if v is not None and v is not False}
        if output_router_logits and self.router_logits_default is None:
            unsupported["output_router_logits"] = output_router_logits
        if unsupported:
            raise TypeError(
                f"a RoundPipe-converted causal LM does not take {sorted(unsupported)}; it accepts "
                "input_ids (or inputs_embeds), attention_mask, position_ids, labels, "
                "num_items_in_batch, return_logits, logits_to_keep and (MoE models) "
                "output_router_logits "
                "(training runs without a KV cache: load the model with use_cache=False)"
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        if input_ids is None and self.per_layer_inputs is not None:
            raise ValueError(
                "this model looks its per-layer inputs up by token id: give input_ids, not "
                "inputs_embeds"
            )
        check_flag(return_logits, "return_logits")
        if not return_logits and labels is None:
            raise ValueError(
                "return_logits=False returns only the loss, so it needs labels=; without labels "
                "call the model with return_logits=True (the default)"
            )
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
            raise TypeError(
                f"logits_to_keep must be an int (keep the last k positions), got {logits_to_keep!r}"
            )
        if logits_to_keep < 0 or (logits_to_keep and labels is not None):
            raise ValueError(
                f"logits_to_keep={logits_to_keep} must be >= 0, and 0 (all positions) when labels "
                "are given: the loss needs the logits of every position"
            )
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_scale is not None:
            scale: Any = self.embed_scale
            if self.embed_scale_as_tensor:
                scale = torch.tensor(scale, dtype=hidden.dtype, device=hidden.device)
            hidden = hidden * scale
        batch, seq = hidden.shape[:2]
        if position_ids is None and self.positions_from_mask and attention_mask is not None:
            counted = attention_mask.to(hidden.device)
            position_ids = (torch.cumsum(counted, dim=1) * counted - 1).long()
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        position_ids = position_ids.to(hidden.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[0] not in (1, batch):
            raise ValueError(
                f"position_ids has batch size {position_ids.shape[0]}, input has {batch}; give "
                "position_ids of shape (batch, seq) or (1, seq)"
            )
        # Expanded so that it can be split into microbatches along dim 0 like the rest.
        position_ids = position_ids.expand(batch, -1).contiguous()
        if self.position_embedding is not None:
            given = {"padding_mask": attention_mask, "position_ids": position_ids}
            args, kwargs = split_call(
                {
                    key: detail if source == "const" else given[source]
                    for key, source, detail in self.position_embedding_inputs
                }
            )
            hidden = hidden + self.position_embedding(*args, **kwargs).to(hidden.device)
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        tables = tuple(
            self.position_modules[i](hidden, position_ids, *type_args)
            for i, type_args in self.position_calls
        )
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    "a RoundPipe-converted causal LM takes a 2D (batch, seq) padding attention_mask, "
                    f"got shape {tuple(attention_mask.shape)}; custom 4D masks are not supported"
                )
            attention_mask = attention_mask.to(hidden.device)
        if labels is not None:
            labels = labels.to(hidden.device)
        extras = {
            "return_logits": return_logits,
            "logits_to_keep": logits_to_keep,
            "num_items_in_batch": _check_num_items(num_items_in_batch, hidden.device),
            "output_router_logits": bool(
                self.router_logits_default if output_router_logits is None else output_router_logits
            ),
            "router_stats": None,
        }
        if self.per_layer_inputs is not None:
            extras["per_layer_inputs"] = self.per_layer_inputs(input_ids, hidden)
        if self.stack is not None:
            hidden = self.stack(hidden)
        return (hidden, tables, position_ids, attention_mask, labels, extras)


def split_call(inputs: dict[str | int, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Positional arguments (int keys, in order) and keyword arguments of a recorded call."""
    positions = sorted(k for k in inputs if isinstance(k, int))
    return [inputs[k] for k in positions], {k: v for k, v in inputs.items() if isinstance(k, str)}


def _check_num_items(value: Any, device: torch.device) -> torch.Tensor | None:
    """``num_items_in_batch`` as a 0-dim tensor (so the engine hands it whole to every microbatch)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"num_items_in_batch must be one number, got a tensor of shape {tuple(value.shape)}"
            )
        return value.reshape(()).to(device)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(
            f"num_items_in_batch must be a positive number (the counted label tokens of the whole "
            f"batch), got {value!r}"
        )
    return torch.tensor(value, device=device)


class GenericDecoderBlock(nn.Module):
    """One decoder layer as one pipeline layer, called as the model's own forward called it.

    Args:
        layer: the Hugging Face decoder layer (shared, not copied).
        config: the model's (text) config (read only).
        recipe: the layer's arguments and where each comes from (:class:`.probe.LayerRecipe`).
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
        self.layer = layer
        self.num_routers = len(routers)
        # Plain (read-only) attributes: never written in forward.
        self.config = config
        self.recipe = recipe

    def forward(self, *state: Any) -> DecoderState:
        hidden, tables, position_ids, attention_mask, labels, extras = unpack_state(state)
        # Gemma 3n's AltUp stack travels batch-first; its layer takes (inputs, batch, ...)
        embeds = hidden[:, 0] if self.recipe.stacked else hidden
        if self.recipe.stacked:
            hidden = hidden.transpose(0, 1).contiguous()
        kwargs: dict[str | int, Any] = {}
        store = None
        for key, source, detail in self.recipe.inputs:
            if source == "const":
                kwargs[key] = detail
            elif source == "padding_mask":
                kwargs[key] = attention_mask
            elif source == "position_ids":
                kwargs[key] = position_ids
            elif source == "cache_position":
                kwargs[key] = torch.arange(embeds.shape[1], device=hidden.device)
            elif source == "table":
                kwargs[key] = tables[detail]
            elif source == "fresh":
                kwargs[key] = detail()
            elif source == "per_layer_input":  # this layer's is first; the rest go on
                rest = extras["per_layer_inputs"]
                kwargs[key] = rest[:, :, 0]
                extras = {**extras, "per_layer_inputs": rest[:, :, 1:]}
            elif source == "shared_kv":  # a fresh store: what the layer stores goes out below
                kwargs[key] = store = detail(extras.get("shared_kv") or {})
            else:  # "mask": rebuilt here from the 2D padding mask
                kind, with_pos, skip = detail
                pos = position_ids if with_pos else None
                kwargs[key] = build_mask(self.config, kind, embeds, attention_mask, pos, skip)
        args, named = split_call(kwargs)

        def run() -> Any:
            return self.layer(hidden, *args, **named)

        if not self.num_routers:
            out = run()
        elif not extras["output_router_logits"]:
            out = run_with_router_replay(run, self.num_routers)
        else:
            captured: list[tuple[torch.Tensor, torch.Tensor]] = []
            out = run_with_router_replay(run, self.num_routers, capture=captured)
            stats = add_router_stats(
                extras["router_stats"], captured, attention_mask, embeds.shape[0], embeds.shape[1]
            )
            # a new dict: the engine may keep the input state for the recompute
            extras = {**extras, "router_stats": None if stats is None else tuple(stats)}
        if self.recipe.tuple_output:
            out = out[0]
        if self.recipe.stacked:
            out = out.transpose(0, 1)
        if store is not None:
            extras = {**extras, "shared_kv": dict(store)}
        return (out, tables, position_ids, attention_mask, labels, extras)
