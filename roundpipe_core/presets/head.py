"""The last pipeline layer of a converted causal LM and the ``ModelOutput`` it returns.

**Why the outputs carry per-sample sums.** The engine merges the microbatch outputs,
and no rule merging scalars gives Hugging Face's loss of the whole batch (a mean over
*all* counted tokens; for MoE a product of two whole-batch averages). So each output
also holds, per sample, its token-loss sum, counted tokens and router sums (the
``per_sample_*`` fields, which merge by concatenation), and computes ``.loss`` /
``.aux_loss`` from them whenever it is built: the merged ``.loss`` is exactly Hugging
Face's, and differentiable (``rp(..., labels=y).loss.backward()``).

This module imports ``transformers``; it is loaded only when a model is converted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from .common import unpack_state
from .loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    chunked_linear_cross_entropy,
    shift_labels,
    token_cross_entropy,
)
from .moe import aux_loss_from_stats
from .probe import apply_logit_ops

__all__ = [
    "LOGIT_OPS",
    "CausalLMOutputAdapter",
    "RoundPipeCausalLMOutput",
    "RoundPipeMoeCausalLMOutput",
]

# What a model's forward may do to its LM head's output (see CausalLMOutputAdapter).
LOGIT_OPS = ("mul", "div", "softcap")


def _canonical_order(out: Any) -> None:
    """Keys in field order, however the output was built: the engine pairs the leaves of a
    microbatch's output with those of the merged output by position."""
    for field in reversed(dataclasses.fields(out)):
        if field.name in out:
            out.move_to_end(field.name, last=False)


def _loss_from_samples(out: Any) -> torch.Tensor | None:
    loss_sum = out.per_sample_loss_sum
    if loss_sum is None:
        return None
    if out.per_sample_num_items is not None:
        # the caller's num_items_in_batch, repeated per sample so that it survives the merge
        denominator = out.per_sample_num_items[0]
    else:
        denominator = out.per_sample_num_tokens.sum()
    return loss_sum.sum() / denominator.to(loss_sum.device)


@dataclasses.dataclass
class RoundPipeCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` of a converted model (``.loss``, ``.logits``).

    Attributes:
        per_sample_loss_sum: ``(B,)`` fp32 sum of each sample's token losses.
        per_sample_num_tokens: ``(B,)`` counted (non-ignored, shifted) tokens per sample.
        per_sample_num_items: ``(B,)`` the ``num_items_in_batch`` of the call, or ``None``.
    """

    per_sample_loss_sum: torch.Tensor | None = None
    per_sample_num_tokens: torch.Tensor | None = None
    per_sample_num_items: torch.Tensor | None = None

    def __post_init__(self) -> None:
        loss = _loss_from_samples(self)
        if loss is not None:
            self.loss = loss
        super().__post_init__()
        _canonical_order(self)


@dataclasses.dataclass
class RoundPipeMoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """``MoeCausalLMOutputWithPast`` of a converted MoE model (``.loss``, ``.aux_loss``, ``.logits``).

    ``router_logits`` is not returned: they would travel through every pipeline stage.

    Attributes:
        per_sample_loss_sum, per_sample_num_tokens, per_sample_num_items: as
            :class:`RoundPipeCausalLMOutput`.
        per_sample_expert_tokens: ``(B, E)`` top-k assignments per expert.
        per_sample_router_probs: ``(B, E)`` summed router probabilities.
        per_sample_router_rows: ``(B,)`` tokens x MoE layers counted.
        per_sample_aux_coef: ``(B,)`` ``router_aux_loss_coef``, repeated per sample.
    """

    per_sample_loss_sum: torch.Tensor | None = None
    per_sample_num_tokens: torch.Tensor | None = None
    per_sample_num_items: torch.Tensor | None = None
    per_sample_expert_tokens: torch.Tensor | None = None
    per_sample_router_probs: torch.Tensor | None = None
    per_sample_router_rows: torch.Tensor | None = None
    per_sample_aux_coef: torch.Tensor | None = None

    def __post_init__(self) -> None:
        loss = _loss_from_samples(self)
        if (
            self.per_sample_router_probs is not None
            and self.per_sample_expert_tokens is not None
            and self.per_sample_router_rows is not None
        ):
            aux = aux_loss_from_stats(
                self.per_sample_expert_tokens,
                self.per_sample_router_probs,
                self.per_sample_router_rows,
            )
            self.aux_loss = aux
            if loss is not None and self.per_sample_aux_coef is not None:
                coef = self.per_sample_aux_coef[0].to(loss.device)
                loss = loss + coef * aux.to(loss.device)
        if loss is not None:
            self.loss = loss
        super().__post_init__()
        _canonical_order(self)


class CausalLMOutputAdapter(nn.Module):
    """Last layer of a converted causal LM: final norm, LM head, loss.

    Args:
        norm: the model's final norm (shared, not copied).
        lm_head: the model's LM head (shared; tied weights stay tied).
        ignore_index: label value without a loss.
        num_experts: MoE models: experts per layer (``None`` for dense models).
        router_aux_loss_coef: MoE models: weight of the aux loss in ``.loss``.
        loss_chunk_tokens: tokens per chunk of the ``return_logits=False`` loss.
        logit_ops: what the model's ``forward`` does to the LM head's output, in order
            (:func:`.probe.apply_logit_ops`); empty for most models.
    """

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        ignore_index: int = IGNORE_INDEX,
        num_experts: int | None = None,
        router_aux_loss_coef: float = 0.0,
        loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
        logit_ops: tuple[tuple[str, float], ...] = (),
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        # Plain (read-only) attributes: never written in forward.
        self.ignore_index = ignore_index
        self.num_experts = num_experts
        self.router_aux_loss_coef = float(router_aux_loss_coef)
        self.loss_chunk_tokens = loss_chunk_tokens
        for op, value in logit_ops:
            if (
                op not in LOGIT_OPS
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                raise ValueError(
                    f"logit_ops takes (op, number) pairs with op in {LOGIT_OPS}, got {(op, value)!r}"
                )
        self.logit_ops = tuple((op, float(value)) for op, value in logit_ops)

    def _token_losses(
        self, hidden: torch.Tensor, logits: torch.Tensor | None, target: torch.Tensor
    ) -> torch.Tensor:
        flat_target = target.reshape(-1)
        if logits is not None:
            return token_cross_entropy(
                logits.reshape(-1, logits.shape[-1]), flat_target, self.ignore_index
            )
        if self.logit_ops:
            raise ValueError(
                "return_logits=False computes the loss from the LM head's weight alone; this model "
                "scales or soft-caps its logits after the head. Call it with return_logits=True"
            )
        head = self.lm_head
        if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
            raise ValueError(
                f"return_logits=False computes the loss from the LM head's weight, which needs a "
                f"plain nn.Linear head; this model's is {type(head).__name__} (e.g. a LoRA-wrapped "
                "lm_head). Call it with return_logits=True"
            )
        return chunked_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            head.bias,
            flat_target,
            self.ignore_index,
            self.loss_chunk_tokens,
        )

    def forward(self, *state: Any) -> Any:
        hidden, _tables, _pos, _mask, labels, extras = unpack_state(state)
        hidden = self.norm(hidden)
        keep = extras.get("logits_to_keep", 0)
        logits = None
        if extras.get("return_logits", True):
            logits = apply_logit_ops(
                self.lm_head(hidden[:, -keep:] if keep else hidden), self.logit_ops
            )
        fields: dict[str, Any] = {"logits": logits}
        batch = hidden.shape[0]
        if labels is not None:
            target = shift_labels(labels, self.ignore_index).to(hidden.device)
            losses = self._token_losses(hidden, logits, target)
            fields["per_sample_loss_sum"] = losses.view(batch, -1).sum(1)
            fields["per_sample_num_tokens"] = (target != self.ignore_index).sum(1)
            num_items = extras.get("num_items_in_batch")
            if num_items is not None:
                fields["per_sample_num_items"] = (
                    num_items.to(hidden.device).reshape(1).expand(batch).clone()
                )
        if self.num_experts is None:
            return RoundPipeCausalLMOutput(**fields)
        stats = extras.get("router_stats")
        if stats is not None:
            expert_tokens, router_probs, rows = stats
            fields["per_sample_expert_tokens"] = expert_tokens
            fields["per_sample_router_probs"] = router_probs
            fields["per_sample_router_rows"] = rows
            fields["per_sample_aux_coef"] = torch.full(
                (batch,), self.router_aux_loss_coef, device=hidden.device
            )
        return RoundPipeMoeCausalLMOutput(**fields)
