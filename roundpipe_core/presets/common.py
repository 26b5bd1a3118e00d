"""Building blocks shared by the Hugging Face presets.

A preset turns a causal language model into an ``nn.Sequential`` of

* an **input adapter** (token embeddings, position ids, rotary cos/sin),
* one **decoder block** per transformer layer, and
* an **output adapter** (final norm + LM head + loss, :mod:`.head`).

The pieces *reuse* the Hugging Face module objects, so the Sequential shares
every parameter with the original model: training it updates the original
model in place and ``model.state_dict()`` stays current. Tied embeddings stay
tied (the input and output adapters hold the same ``Parameter``). What travels
between the layers is described in :mod:`.state`; each block rebuilds its 4D
attention mask with Hugging Face's own mask functions (``create_causal_mask``
and friends), which keeps the conversion exact for every attention
implementation (eager, sdpa, flash).

Forward rules (what a layer may do when RoundPipe runs it): none of these modules writes a plain attribute
or a shared buffer during forward, and every temporary is created on the
device of its input.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..kinds import check_flag
from .loss import IGNORE_INDEX
from .moe import (
    Rescore,
    RouterStats,
    add_router_stats,
    install_router_replay,
    rescore_softmax_then_topk,
    run_with_router_replay,
)
from .state import DecoderState, unpack_state

__all__ = [
    "CausalLMInputAdapter",
    "DecoderBlock",
    "build_sequential",
    "convert_rotary_decoder_lm",
    "mask_functions",
    "output_adapter",
    "prepare_hf_model",
    "split_call",
]


# --------------------------------------------------------------------------- adapters


class CausalLMInputAdapter(nn.Module):
    """Layer 0 of a converted causal LM: embeddings, position ids, rotary tables, call options.

    Args:
        embed_tokens: the model's token embedding (shared, not copied).
        rotary_emb: the model's rotary embedding module, or ``None``.
        position_embedding: learned absolute position embedding (GPT-2), or ``None``.
        dropout: embedding dropout (GPT-2), or ``None``.
        router_logits_default: MoE models: ``config.output_router_logits`` (the
            default of ``output_router_logits``); ``None`` for dense models,
            which do not take the argument.
        embed_scale: multiply the embeddings (also given ``inputs_embeds``) by this
            (Granite's ``embedding_multiplier``, AFMoE's ``hidden_size ** 0.5``), or ``None``.
        embed_scale_as_tensor: multiply by a tensor of the embeddings' dtype
            (``torch.tensor(scale, dtype=hidden.dtype)``, as Gemma-style code writes it)
            instead of a Python float; the two round differently in half precision.
        position_tables: instead of ``rotary_emb``: the position-embedding calls of a
            model whose layers take different tables (Gemma 3's local and global
            rotary embeddings), as ``(module, layer_type or None)`` pairs. Each is
            computed once, ``module(hidden, position_ids[, layer_type])``, and the
            state's ``cos`` field holds their outputs as a tuple in this order
            (``sin`` is ``None``); a block picks its table by index.
        position_embedding_inputs: how ``position_embedding`` is called, as
            ``(keyword or position, source, detail)`` triples with sources ``"const"``
            (detail: the value), ``"padding_mask"`` and ``"position_ids"`` (OPT's
            ``embed_positions(attention_mask, 0, position_ids=...)``); ``None``:
            ``position_embedding(position_ids)``.
        positions_from_mask: default position ids counted over the padding mask,
            ``cumsum(mask) * mask - 1`` (OPT), instead of ``0..S-1``.
    """

    def __init__(
        self,
        embed_tokens: nn.Module,
        rotary_emb: nn.Module | None = None,
        position_embedding: nn.Module | None = None,
        dropout: nn.Module | None = None,
        router_logits_default: bool | None = None,
        embed_scale: float | None = None,
        embed_scale_as_tensor: bool = False,
        position_tables: Sequence[tuple[nn.Module, str | None]] | None = None,
        position_embedding_inputs: Sequence[tuple[str | int, str, Any]] | None = None,
        positions_from_mask: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.position_embedding = position_embedding
        self.position_embedding_inputs = (
            None if position_embedding_inputs is None else tuple(position_embedding_inputs)
        )
        self.positions_from_mask = positions_from_mask
        self.dropout = dropout
        self.router_logits_default = router_logits_default
        self.embed_scale = embed_scale
        self.embed_scale_as_tensor = embed_scale_as_tensor
        self.position_modules: nn.ModuleList | None = None
        self.position_calls: tuple[tuple[int, str | None], ...] = ()
        if position_tables is not None:
            if rotary_emb is not None:
                raise ValueError("give rotary_emb or position_tables, not both")
            modules: list[nn.Module] = []
            calls = []
            for module, layer_type in position_tables:
                index = next((i for i, m in enumerate(modules) if m is module), len(modules))
                if index == len(modules):
                    modules.append(module)
                calls.append((index, layer_type))
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
        """Embed the tokens and build the decoder state (see :mod:`.state`).

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
            if self.embed_scale_as_tensor:
                hidden = hidden * torch.tensor(
                    self.embed_scale, dtype=hidden.dtype, device=hidden.device
                )
            else:
                hidden = hidden * self.embed_scale
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
            if self.position_embedding_inputs is None:
                positions = self.position_embedding(position_ids)
            else:
                given = {"padding_mask": attention_mask, "position_ids": position_ids}
                args, kwargs = split_call(
                    {
                        key: detail if source == "const" else given[source]
                        for key, source, detail in self.position_embedding_inputs
                    }
                )
                positions = self.position_embedding(*args, **kwargs)
            hidden = hidden + positions.to(hidden.device)
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        cos = sin = None
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb(hidden, position_ids)
        elif self.position_modules is not None:
            cos = tuple(
                self.position_modules[i](hidden, position_ids)
                if layer_type is None
                else self.position_modules[i](hidden, position_ids, layer_type)
                for i, layer_type in self.position_calls
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
        if output_router_logits is None:
            output_router_logits = bool(self.router_logits_default)
        extras = {
            "return_logits": return_logits,
            "logits_to_keep": logits_to_keep,
            "num_items_in_batch": _check_num_items(num_items_in_batch, hidden.device),
            "output_router_logits": bool(output_router_logits),
            "router_stats": None,
        }
        return (hidden, cos, sin, position_ids, attention_mask, labels, extras)


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


MaskFn = Callable[..., Any]


class DecoderBlock(nn.Module):
    """One Hugging Face decoder layer as one pipeline layer.

    It rebuilds the 4D attention mask for its layer type from the 2D padding
    mask (with the same Hugging Face function the original model uses), then
    calls the original layer.

    Args:
        layer: the Hugging Face decoder layer (shared, not copied).
        config: the model config (read only).
        mask_fn: ``create_causal_mask`` or ``create_sliding_window_causal_mask``.
        rotary: whether the layer takes ``position_embeddings=(cos, sin)``.
        routers: router modules inside the layer whose top-k choice must be
            replayed in the recompute pass (MoE), see :mod:`.moe`.
        mask_with_position_ids: pass ``position_ids`` to the mask function (as
            the original model does; GPT-OSS does not).
    """

    def __init__(
        self,
        layer: nn.Module,
        config: Any,
        mask_fn: MaskFn,
        rotary: bool = True,
        routers: Sequence[nn.Module] = (),
        mask_with_position_ids: bool = True,
    ) -> None:
        super().__init__()
        self.layer = layer
        # Plain (read-only) attributes: never written in forward.
        self.config = config
        self.mask_fn = mask_fn
        self.rotary = rotary
        self.num_routers = len(routers)
        self.mask_with_position_ids = mask_with_position_ids

    def forward(self, *state: Any) -> DecoderState:
        hidden, cos, sin, position_ids, attention_mask, labels, extras = unpack_state(state)
        mask_kwargs: dict[str, Any] = {
            "config": self.config,
            "inputs_embeds": hidden,
            "attention_mask": attention_mask,
            "cache": None,
        }
        if self.mask_with_position_ids:
            mask_kwargs["position_ids"] = position_ids
        kwargs: dict[str, Any] = {
            "attention_mask": self.mask_fn(**mask_kwargs),
            "position_ids": position_ids,
        }
        if self.rotary:
            kwargs["position_embeddings"] = (cos, sin)
        out, extras = call_layer(
            lambda: self.layer(hidden, **kwargs), self.num_routers, extras, attention_mask, hidden
        )
        return (out, cos, sin, position_ids, attention_mask, labels, extras)


def call_layer(
    run: Callable[[], Any],
    num_routers: int,
    extras: dict[str, Any],
    attention_mask: torch.Tensor | None,
    hidden: torch.Tensor,
) -> tuple[Any, dict[str, Any]]:
    """Run a decoder layer (``run()``); with MoE routers, replay their choices in recompute
    and, when the call asks for ``output_router_logits``, add their statistics to
    ``extras`` (a new dict: the input state may be kept by the engine for the recompute)."""
    if not num_routers:
        return run(), extras
    captured: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    if extras["output_router_logits"]:
        captured = []
    out = run_with_router_replay(run, num_routers, capture=captured)
    if captured is not None:
        previous = extras["router_stats"]
        stats = add_router_stats(
            None if previous is None else RouterStats(*previous),
            captured,
            attention_mask,
            hidden.shape[0],
            hidden.shape[1],
        )
        extras = {**extras, "router_stats": None if stats is None else tuple(stats)}
    return out, extras


# --------------------------------------------------------------------------- helpers


def prepare_hf_model(model: Any) -> None:
    """Settings a Hugging Face model needs before conversion (training without cache)."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers < 5
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        # RoundPipe already recomputes every stage; HF checkpointing on top would run it twice.
        warnings.warn(
            "Hugging Face gradient checkpointing is turned off for RoundPipe, which recomputes "
            "activations itself",
            RuntimeWarning,
            stacklevel=3,
        )
        disable = getattr(model, "activation_checkpointing_disable", None)
        (disable or model.gradient_checkpointing_disable)()


def build_sequential(
    input_adapter: nn.Module, blocks: Sequence[nn.Module], output_adapter: nn.Module
) -> nn.Sequential:
    """``nn.Sequential(input_adapter, *blocks, output_adapter)``."""
    return nn.Sequential(input_adapter, *blocks, output_adapter)


def mask_functions(config: Any) -> tuple[MaskFn, MaskFn]:
    """Hugging Face's (full, sliding-window) causal mask builders."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    return create_causal_mask, create_sliding_window_causal_mask


def output_adapter(
    norm: nn.Module,
    lm_head: nn.Module,
    num_experts: int | None = None,
    router_aux_loss_coef: float = 0.0,
    logit_ops: tuple[tuple[str, float], ...] = (),
) -> nn.Module:
    """The last layer (:class:`.head.CausalLMOutputAdapter`); ``num_experts`` only for MoE models,
    ``logit_ops`` for models that scale or soft-cap their logits."""
    # imported here: .head needs transformers, an optional dependency of roundpipe_core
    from .head import CausalLMOutputAdapter

    return CausalLMOutputAdapter(
        norm,
        lm_head,
        ignore_index=IGNORE_INDEX,
        num_experts=num_experts,
        router_aux_loss_coef=router_aux_loss_coef,
        logit_ops=logit_ops,
    )


def convert_rotary_decoder_lm(
    model: Any,
    layer_kinds: Sequence[str] | None = None,
    router_of: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    rescore: Rescore = rescore_softmax_then_topk,
    mask_with_position_ids: bool = True,
) -> nn.Sequential:
    """Convert a Llama-family causal LM (``model.model.{embed_tokens,layers,norm,rotary_emb}``, ``model.lm_head``).

    Args:
        model: the ``*ForCausalLM`` module.
        layer_kinds: per layer ``"full_attention"`` or ``"sliding_attention"``;
            ``None`` = all full.
        router_of: MoE models: the routers inside a decoder layer (empty for
            dense layers); their choices are replayed in recompute, and the
            model takes ``output_router_logits`` (needs ``model.num_experts``
            and ``model.router_aux_loss_coef``, as Hugging Face's MoE models have).
        rescore: how the routers turn logits into the weights of given experts.
        mask_with_position_ids: whether the original model passes
            ``position_ids`` to its mask functions.
    """
    prepare_hf_model(model)
    backbone = model.model
    config = model.config
    full_mask, sliding_mask = mask_functions(config)
    layers = list(backbone.layers[: config.num_hidden_layers])
    if layer_kinds is None:
        layer_kinds = ["full_attention"] * len(layers)
    blocks = []
    for layer, kind in zip(layers, layer_kinds):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"unsupported attention layer type {kind!r} for a RoundPipe preset")
        routers = list(router_of(layer)) if router_of is not None else []
        for router in routers:
            install_router_replay(router, rescore)
        blocks.append(
            DecoderBlock(
                layer,
                config,
                sliding_mask if kind == "sliding_attention" else full_mask,
                rotary=True,
                routers=routers,
                mask_with_position_ids=mask_with_position_ids,
            )
        )
    moe = router_of is not None
    return build_sequential(
        CausalLMInputAdapter(
            backbone.embed_tokens,
            rotary_emb=backbone.rotary_emb,
            router_logits_default=bool(getattr(config, "output_router_logits", False))
            if moe
            else None,
        ),
        blocks,
        output_adapter(
            backbone.norm,
            model.lm_head,
            num_experts=int(model.num_experts) if moe else None,
            router_aux_loss_coef=float(getattr(model, "router_aux_loss_coef", 0.0)) if moe else 0.0,
        ),
    )
