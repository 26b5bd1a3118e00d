"""Building blocks shared by the Hugging Face presets.

A preset turns a causal language model into an ``nn.Sequential`` of

* an **input adapter** (token embeddings, position ids, rotary cos/sin),
* one **decoder block** per transformer layer, and
* an **output adapter** (final norm + LM head).

The pieces *reuse* the Hugging Face module objects, so the Sequential shares
every parameter with the original model: training it updates the original
model in place and ``model.state_dict()`` stays current. Tied embeddings stay
tied (the input and output adapters hold the same ``Parameter``).

What travels between layers is a plain tuple, the *decoder state*::

    (hidden_states, cos, sin, position_ids, attention_mask_2d, labels)

Every tensor in it has the batch as dim 0, so the engine can split
microbatches along dim 0. The 4D attention mask is deliberately **not** passed
between layers: for long sequences a ``(B, 1, S, S)`` mask is larger than the
hidden states, so each block rebuilds it from the 2D padding mask on its own
device with Hugging Face's own mask functions (``create_causal_mask`` and
friends), which is what keeps the conversion exact for every attention
implementation (eager, sdpa, flash).

Forward-rule notes (seed 004): none of these modules writes a plain attribute
or a shared buffer during forward, and every temporary is created on the
device of its input.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..context import current_layer, doing_recompute, get_recompute_data, save_for_recompute

IGNORE_INDEX = -100

DecoderState = tuple[Any, ...]
STATE_FIELDS = ("hidden_states", "cos", "sin", "position_ids", "attention_mask", "labels")


def _unpack_state(state: tuple[Any, ...]) -> DecoderState:
    """Accept the decoder state either splatted (``layer(*state)``) or as one tuple."""
    if len(state) == 1 and isinstance(state[0], (tuple, list)):
        state = tuple(state[0])
    if len(state) != len(STATE_FIELDS):
        raise TypeError(
            f"a preset layer expects the decoder state {STATE_FIELDS} from the previous layer, "
            f"got {len(state)} values; run the layers of a converted model in order"
        )
    return state


# --------------------------------------------------------------------------- loss


def _logits_of(output: Any) -> torch.Tensor:
    """The logits of a preset output: a tensor, a dict or a ``ModelOutput``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"causal_lm_loss expects logits (a tensor, or an object with .logits), got {type(output).__name__}"
    )


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Hugging Face's label shift: token ``t`` predicts label ``t + 1``; the last position is ignored."""
    padded = nn.functional.pad(labels, (0, 1), value=ignore_index)
    return padded[..., 1:]


def count_label_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Number of tokens that contribute to the causal-LM loss of ``labels`` (after the shift)."""
    return int((shift_labels(labels, ignore_index) != ignore_index).sum())


def causal_lm_loss(
    output: Any,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``ForCausalLMLoss``) on one (micro)batch.

    Labels are shifted inside (pass ``labels = input_ids`` with padding set to
    ``-100``), the cross-entropy is computed in fp32.

    Args:
        output: logits ``(B, S, V)``, or a preset output carrying ``logits``.
        labels: ``(B, S)`` token ids, ``ignore_index`` where no loss is wanted.
        num_items_in_batch: ``None`` = mean over this batch's counted tokens
            (exactly ``model(..., labels=labels).loss``). A number = sum of the
            token losses divided by it (HF's gradient-accumulation mode).
        ignore_index: label value that is skipped.

    Returns:
        Scalar loss.

    Note:
        ``forward_backward`` sums the per-microbatch losses. Passing this
        function directly as ``loss_fn`` therefore gives the *sum of the
        microbatch means*, which is not HF's loss of the whole batch (the
        microbatches hold different numbers of counted tokens). Use
        :func:`causal_lm_loss_fn` to get HF's loss exactly.
    """
    logits = _logits_of(output).float()
    target = shift_labels(labels, ignore_index).to(logits.device)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    if num_items_in_batch is None:
        return nn.functional.cross_entropy(flat_logits, flat_target, ignore_index=ignore_index)
    total = nn.functional.cross_entropy(
        flat_logits, flat_target, ignore_index=ignore_index, reduction="sum"
    )
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class CausalLMLossFn:
    """``loss_fn`` for ``forward_backward`` whose microbatch sum equals HF's loss of the whole batch.

    Every microbatch divides the *sum* of its token losses by the number of
    counted tokens in the **whole** batch, so the engine's sum over
    microbatches is exactly the mean over all counted tokens -- the value
    ``hf_model(..., labels=labels).loss`` returns, and the gradient it gives.
    """

    def __init__(self, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index
        self.num_items_in_batch = count_label_tokens(labels, ignore_index)

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(output, labels, self.num_items_in_batch, self.ignore_index)


def causal_lm_loss_fn(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> CausalLMLossFn:
    """Make the ``loss_fn`` for ``forward_backward(label=labels, ...)`` of a converted causal LM.

    Example::

        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels, loss_fn=causal_lm_loss_fn(labels))
        # loss == hf_model(input_ids=ids, attention_mask=mask, labels=labels).loss
    """
    return CausalLMLossFn(labels, ignore_index)


@dataclasses.dataclass
class CausalLMOutput:
    """What a converted causal LM returns when it is called with ``labels``.

    Each microbatch returns the *sum* of its token losses and its number of
    counted tokens; the engine's default merge concatenates ``logits`` and sums
    the two scalars, so :attr:`loss` of the merged output is exactly HF's loss
    of the whole batch (mean over all counted tokens), and it is
    differentiable: ``rp(input_ids=..., labels=...).loss.backward()`` works.

    Attributes:
        logits: ``(B, S, V)``.
        loss_sum: sum of the token cross-entropies (fp32 scalar).
        num_items: number of counted (non-ignored, shifted) tokens.
    """

    logits: torch.Tensor
    loss_sum: torch.Tensor | None = None
    num_items: torch.Tensor | None = None

    @property
    def loss(self) -> torch.Tensor | None:
        """HF's causal-LM loss: ``loss_sum / num_items``."""
        if self.loss_sum is None or self.num_items is None:
            return None
        return self.loss_sum / self.num_items.to(self.loss_sum.device)


# --------------------------------------------------------------------------- adapters


class CausalLMInputAdapter(nn.Module):
    """Layer 0 of a converted causal LM: embeddings, position ids, rotary tables.

    Args:
        embed_tokens: the model's token embedding (shared, not copied).
        rotary_emb: the model's rotary embedding module, or ``None``.
        position_embedding: learned absolute position embedding (GPT-2), or ``None``.
        dropout: embedding dropout (GPT-2), or ``None``.
    """

    def __init__(
        self,
        embed_tokens: nn.Module,
        rotary_emb: nn.Module | None = None,
        position_embedding: nn.Module | None = None,
        dropout: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.position_embedding = position_embedding
        self.dropout = dropout

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **unsupported: Any,
    ) -> DecoderState:
        """Embed the tokens and build the decoder state (see module docstring)."""
        unsupported = {k: v for k, v in unsupported.items() if v is not None and v is not False}
        if unsupported:
            raise TypeError(
                f"a RoundPipe-converted causal LM does not take {sorted(unsupported)}; it accepts "
                "input_ids (or inputs_embeds), attention_mask, position_ids and labels "
                "(training runs without a KV cache: load the model with use_cache=False)"
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq = hidden.shape[:2]
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
            hidden = hidden + self.position_embedding(position_ids).to(hidden.device)
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        cos = sin = None
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb(hidden, position_ids)
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    "a RoundPipe-converted causal LM takes a 2D (batch, seq) padding attention_mask, "
                    f"got shape {tuple(attention_mask.shape)}; custom 4D masks are not supported"
                )
            attention_mask = attention_mask.to(hidden.device)
        if labels is not None:
            labels = labels.to(hidden.device)
        return (hidden, cos, sin, position_ids, attention_mask, labels)


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
            replayed in the recompute pass (MoE), see :func:`install_router_replay`.
    """

    def __init__(
        self,
        layer: nn.Module,
        config: Any,
        mask_fn: MaskFn,
        rotary: bool = True,
        routers: Sequence[nn.Module] = (),
    ) -> None:
        super().__init__()
        self.layer = layer
        # Plain (read-only) attributes: never written in forward.
        self.config = config
        self.mask_fn = mask_fn
        self.rotary = rotary
        self.num_routers = len(routers)

    def forward(self, *state: Any) -> DecoderState:
        hidden, cos, sin, position_ids, attention_mask, labels = _unpack_state(state)
        mask = self.mask_fn(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids}
        if self.rotary:
            kwargs["position_embeddings"] = (cos, sin)
        if self.num_routers:
            hidden = _run_with_router_replay(lambda: self.layer(hidden, **kwargs), self.num_routers)
        else:
            hidden = self.layer(hidden, **kwargs)
        return (hidden, cos, sin, position_ids, attention_mask, labels)


class CausalLMOutputAdapter(nn.Module):
    """Last layer of a converted causal LM: final norm and LM head.

    Returns the logits, or -- when ``labels`` were given to the model -- a
    :class:`CausalLMOutput` whose merged ``.loss`` is HF's loss over the whole batch.
    """

    def __init__(
        self, norm: nn.Module, lm_head: nn.Module, ignore_index: int = IGNORE_INDEX
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.ignore_index = ignore_index

    def forward(self, *state: Any) -> Any:
        hidden, _cos, _sin, _pos, _mask, labels = _unpack_state(state)
        logits = self.lm_head(self.norm(hidden))
        if labels is None:
            return logits
        loss_sum = causal_lm_loss(
            logits, labels, num_items_in_batch=1, ignore_index=self.ignore_index
        )
        num_items = (shift_labels(labels, self.ignore_index) != self.ignore_index).sum()
        return CausalLMOutput(logits=logits, loss_sum=loss_sum, num_items=num_items)


# --------------------------------------------------------------------------- MoE routing replay

_routing = threading.local()


def _run_with_router_replay(run: Callable[[], torch.Tensor], num_routers: int) -> torch.Tensor:
    """Run a layer so that its routers' top-k choices are kept for / replayed in the recompute.

    In the forward pass the choices are recorded and handed to
    ``save_for_recompute``; in the recompute pass they are fetched with
    ``get_recompute_data`` and the routers reuse them (the routing weights are
    still recomputed, so their gradient flows). Routing can differ between the
    two passes (non-deterministic kernels, ties, jitter noise); without the
    replay the backward would differentiate a different network.
    """
    if current_layer() is None:  # plain PyTorch use of the model: nothing to keep
        return run()
    if doing_recompute():
        saved = get_recompute_data()
        if not isinstance(saved, (tuple, list)) or len(saved) != num_routers:
            raise RuntimeError(
                f"expected the routing of {num_routers} router(s) saved by the forward pass, got {saved!r}"
            )
        _routing.replay = list(saved)
        try:
            out = run()
            if _routing.replay:
                raise RuntimeError(
                    "a router saved in forward was not called again in the recompute"
                )
        finally:
            _routing.replay = None
        return out
    _routing.record = []
    try:
        out = run()
        recorded = tuple(_routing.record)
    finally:
        _routing.record = None
    if len(recorded) != num_routers:
        raise RuntimeError(
            f"expected {num_routers} router call(s) in this layer's forward, saw {len(recorded)}"
        )
    save_for_recompute(recorded)
    return out


def topk_router_replay_hook(
    module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...] | None:
    """Forward hook for a top-k router returning ``(router_logits, scores, indices)``.

    Outside a RoundPipe layer it does nothing. In forward it records the
    chosen experts; in recompute it replaces them by the recorded ones and
    recomputes the routing weights of *those* experts from the router logits
    the same way the router does (softmax in fp32, gather, optional
    renormalisation), so gradients reach the router weights.
    """
    record = getattr(_routing, "record", None)
    replay = getattr(_routing, "replay", None)
    if record is None and replay is None:
        return None
    router_logits, _scores, indices = output
    if record is not None:
        record.append(indices.detach())
        return None
    saved = replay.pop(0).to(indices.device)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    scores = probs.gather(-1, saved)
    if getattr(module, "norm_topk_prob", False):
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return router_logits, scores.to(router_logits.dtype), saved


def install_router_replay(router: nn.Module) -> None:
    """Register :func:`topk_router_replay_hook` on ``router`` once (idempotent)."""
    if topk_router_replay_hook not in router._forward_hooks.values():
        router.register_forward_hook(topk_router_replay_hook)


# --------------------------------------------------------------------------- helpers


def prepare_hf_model(model: nn.Module) -> None:
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


def convert_rotary_decoder_lm(
    model: nn.Module,
    layer_kinds: Sequence[str] | None = None,
    router_of: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
) -> nn.Sequential:
    """Convert a Llama-family causal LM (``model.model.{embed_tokens,layers,norm,rotary_emb}``, ``model.lm_head``).

    Args:
        model: the ``*ForCausalLM`` module.
        layer_kinds: per layer ``"full_attention"`` or ``"sliding_attention"``;
            ``None`` = all full.
        router_of: returns the MoE routers inside a decoder layer whose choices
            must be replayed in recompute (empty for dense layers).
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
            install_router_replay(router)
        blocks.append(
            DecoderBlock(
                layer,
                config,
                sliding_mask if kind == "sliding_attention" else full_mask,
                rotary=True,
                routers=routers,
            )
        )
    return build_sequential(
        CausalLMInputAdapter(backbone.embed_tokens, rotary_emb=backbone.rotary_emb),
        blocks,
        CausalLMOutputAdapter(backbone.norm, model.lm_head),
    )
