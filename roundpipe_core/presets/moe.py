"""Mixture-of-experts support of the converter: routing replay and the load-balancing loss.

**Routing replay** (docs/presets.md): a forward hook on each router records its choice in
the forward (``save_for_recompute``) and substitutes it in the recompute
(``get_recompute_data``); the replayed experts' weights are recomputed from the router
logits (its ``rescore``), so the router still gets its gradient.

**Load-balancing loss** (``output_router_logits=True``). Hugging Face's
``load_balancing_loss_func`` is, per expert, (share of top-k assignments) x (mean router
probability), both averaged over the non-padding tokens of all MoE layers of the *whole
batch*. So each decoder block adds per-sample sums to ``RouterStats`` travelling with the
hidden states; they concatenate over microbatches, and the output turns them into the
whole batch's loss exactly (:func:`aux_loss_from_stats`), differentiably.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..context import current_layer, doing_recompute, get_recompute_data, save_for_recompute

__all__ = [
    "RouterStats",
    "Rescore",
    "add_router_stats",
    "aux_loss_from_stats",
    "install_router_replay",
    "rescore_softmax_then_topk",
    "rescore_softmax_topk_renormalised",
    "rescore_topk_then_softmax",
    "run_with_router_replay",
]

# (router module, router logits (N, E), replayed expert indices (N, k)) -> routing weights (N, k)
Rescore = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class RouterStats(NamedTuple):
    """Per-sample sums behind the load-balancing loss (batch-leading, so microbatches concatenate).

    Attributes:
        expert_tokens: ``(B, E)`` top-k assignments per expert over the sample's
            non-padding tokens, summed over MoE layers (no gradient).
        router_probs: ``(B, E)`` router softmax probabilities summed the same way
            (differentiable).
        rows: ``(B,)`` non-padding tokens of the sample times the MoE layers seen.
    """

    expert_tokens: torch.Tensor
    router_probs: torch.Tensor
    rows: torch.Tensor


def rescore_softmax_then_topk(
    router: nn.Module, router_logits: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Qwen-MoE style weights: fp32 softmax over all experts, gathered, optionally renormalised."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    scores = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", False):
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(router_logits.dtype)


def rescore_softmax_topk_renormalised(
    router: nn.Module, router_logits: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Mixtral style weights: fp32 softmax over all experts, gathered, always renormalised."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    scores = probs.gather(-1, indices)
    return scores / scores.sum(dim=-1, keepdim=True)


def rescore_topk_then_softmax(
    router: nn.Module, router_logits: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """GPT-OSS style weights: softmax over the chosen experts' logits only."""
    top = router_logits.gather(-1, indices)
    return torch.softmax(top, dim=1, dtype=top.dtype)


# --------------------------------------------------------------------------- per-thread routing state

_routing = threading.local()


def _replay_hook(
    rescore: Rescore,
    module: nn.Module,
    args: tuple[Any, ...],
    output: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, ...] | None:
    """Forward hook of a top-k router returning ``(router_logits, scores, indices)``."""
    record = getattr(_routing, "record", None)
    replay = getattr(_routing, "replay", None)
    capture = getattr(_routing, "capture", None)
    if record is None and replay is None and capture is None:
        return None  # plain PyTorch use of the model
    router_logits, scores, indices = output
    result = None
    if record is not None:
        record.append(indices.detach())
    elif replay is not None:
        indices = replay.pop(0).to(indices.device)
        result = (router_logits, rescore(module, router_logits, indices), indices)
    if capture is not None:
        capture.append((router_logits, indices))
    return result


def install_router_replay(router: nn.Module, rescore: Rescore = rescore_softmax_then_topk) -> None:
    """Register the replay/capture hook once on ``router``, a module returning
    ``(router_logits, scores, indices)`` that weighs given experts as ``rescore`` does."""
    for hook in router._forward_hooks.values():
        if getattr(hook, "func", None) is _replay_hook:
            return
    router.register_forward_hook(functools.partial(_replay_hook, rescore))


def run_with_router_replay(
    run: Callable[[], torch.Tensor],
    num_routers: int,
    capture: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Run a layer so that its routers' top-k choices are kept for / replayed in the recompute.

    Args:
        run: calls the layer.
        num_routers: routers (with :func:`install_router_replay`) the layer calls.
        capture: if given, ``(router_logits, indices)`` of every router call are
            appended to it (the indices actually used, replayed ones included).
    """
    _routing.capture = capture
    try:
        if current_layer() is None:  # plain PyTorch use of the converted model: nothing to keep
            return run()
        if doing_recompute():
            saved = get_recompute_data()
            if not isinstance(saved, (tuple, list)) or len(saved) != num_routers:
                raise RuntimeError(
                    f"expected the routing of {num_routers} router(s) saved by the forward pass, got {saved!r}"
                )
            _routing.replay = list(saved)
            out = run()
            if _routing.replay:
                raise RuntimeError(
                    "a router saved in forward was not called again in the recompute"
                )
            return out
        _routing.record = []
        out = run()
        recorded = tuple(_routing.record)
        if len(recorded) != num_routers:
            raise RuntimeError(
                f"expected {num_routers} router call(s) in this layer's forward, saw {len(recorded)}"
            )
        save_for_recompute(*recorded)
        return out
    finally:  # the thread's routing state ends with the layer call, however it ends
        _routing.capture = _routing.replay = _routing.record = None


# --------------------------------------------------------------------------- load-balancing loss


def add_router_stats(
    stats: tuple[torch.Tensor, ...] | None,
    captured: list[tuple[torch.Tensor, torch.Tensor]],
    attention_mask: torch.Tensor | None,
    batch: int,
    seq: int,
) -> tuple[torch.Tensor, ...] | None:
    """``stats`` (a :class:`RouterStats` tuple, or ``None``) plus the per-sample sums of
    ``captured``, the ``(router_logits (B*S, E), indices (B*S, k))`` of each router call, as a
    :class:`RouterStats`; padding (``attention_mask`` 0) does not count."""
    for logits, indices in captured:
        num_experts = logits.shape[-1]
        probs = torch.softmax(logits.float(), dim=-1).view(batch, seq, num_experts)
        if attention_mask is None:
            mask = torch.ones(batch, seq, dtype=torch.float32, device=probs.device)
        else:
            mask = attention_mask.to(device=probs.device, dtype=torch.float32)
        chosen = torch.zeros(batch * seq, num_experts, dtype=torch.float32, device=probs.device)
        chosen.scatter_add_(1, indices, torch.ones(indices.shape, device=probs.device))
        sums = RouterStats(
            (chosen.view(batch, seq, num_experts) * mask.unsqueeze(-1)).sum(1),
            (probs * mask.unsqueeze(-1)).sum(1),
            mask.sum(1),
        )
        if stats is not None:
            sums = RouterStats(*(old + new.to(old.device) for old, new in zip(stats, sums)))
        stats = sums
    return stats


def aux_loss_from_stats(
    expert_tokens: torch.Tensor, router_probs: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Hugging Face's ``load_balancing_loss_func`` from the per-sample sums of a (micro)batch."""
    total_rows = rows.sum()
    tokens_per_expert = expert_tokens.sum(0) / total_rows
    prob_per_expert = router_probs.sum(0) / total_rows
    return (tokens_per_expert * prob_per_expert).sum() * expert_tokens.shape[-1]
