"""Causal-LM losses of converted models, including the chunked linear + cross-entropy.

With ``return_logits=False`` the loss is computed by :func:`chunked_linear_cross_entropy`
from the final hidden states and the LM-head weight a chunk of tokens at a time: at 2K
tokens a 152K-vocab head's fp32 logits alone are ~1.2 GB per microbatch. Nothing here
imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..kinds import check_int

__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "IGNORE_INDEX",
    "CausalLMLossFn",
    "causal_lm_loss",
    "causal_lm_loss_fn",
    "chunked_linear_cross_entropy",
    "count_label_tokens",
    "shift_labels",
    "token_cross_entropy",
]

IGNORE_INDEX = -100
# Tokens per chunk of the chunked loss: big enough to keep the matmuls efficient on a GPU,
# small enough that a chunk's fp32 logits (tokens x vocab) stay a few hundred MB at 150K vocab.
DEFAULT_LOSS_CHUNK_TOKENS = 1024


def _logits_of(output: Any) -> torch.Tensor:
    """The logits of a preset output: a tensor, a dict or a ``ModelOutput``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and output.get("logits") is not None:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"causal_lm_loss expects logits (a tensor, or an object with .logits), got "
        f"{type(output).__name__}; a model called with return_logits=False has no logits -- "
        "use its .loss instead"
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
        Passed directly as ``loss_fn``, ``forward_backward`` gives the *sum of the
        microbatch means* (``loss_reduction="sum"``) or their row-weighted mean
        (``"mean"``), neither of which is HF's loss of the whole batch when the
        microbatches hold different numbers of counted tokens. Use
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

    #: its losses are shares of the whole batch's: ``forward_backward(loss_reduction="mean")``
    #: adds them up like ``"sum"`` instead of weighting them by microbatch rows again
    batch_normalized = True

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


# --------------------------------------------------------------------------- per-token losses


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(
            f"label {value} is outside the vocabulary (0..{vocab - 1}); use {ignore_index} "
            "for positions without a loss"
        )


def token_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token fp32 cross-entropy of ``logits (N, V)`` against ``target (N,)``; 0 where ignored."""
    _check_targets(target, logits.shape[-1], ignore_index)
    return nn.functional.cross_entropy(
        logits.float(), target, ignore_index=ignore_index, reduction="none"
    )


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token ``cross_entropy(linear(hidden, weight, bias).float(), target)`` in token chunks.

    Forward keeps one chunk's logits at a time and saves only the per-token
    log-sum-exp. Backward recomputes each chunk's logits (one extra head
    matmul, the price of never holding all of them), turns them into the
    softmax in place and scales it by the incoming per-token gradient, so any
    use of the per-token losses (sums, per-sample weights) differentiates
    exactly. The weight gradient is accumulated over chunks in fp32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        ignore_index: int,
        chunk: int,
    ) -> torch.Tensor:
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty_like(losses)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            logits = nn.functional.linear(hidden[sl], weight, bias).float()
            t = target[sl]
            valid = t != ignore_index
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
            losses[sl] = (lse - picked) * valid
            lse_all[sl] = lse
            del logits
        ctx.save_for_backward(hidden, weight, bias, target, lse_all)
        ctx.ignore_index, ctx.chunk = ignore_index, chunk
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> Any:
        hidden, weight, bias, target, lse_all = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = (
            torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            h = hidden[sl]
            t = target[sl]
            valid = t != ctx.ignore_index
            # softmax(logits) - onehot(target), scaled by each token's incoming gradient
            g = nn.functional.linear(h, weight, bias).float()
            g.sub_(lse_all[sl].unsqueeze(1)).exp_()
            rows = torch.arange(g.shape[0], device=g.device)
            g[rows, torch.where(valid, t, 0)] -= 1.0
            g.mul_((grad_losses[sl] * valid).unsqueeze(1))
            if grad_b is not None:
                grad_b += g.sum(0)
            if grad_w is not None:
                grad_w.addmm_(g.t(), h.float())
            if grad_h is not None:
                grad_h[sl] = g.to(h.dtype) @ weight
            del g
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T + bias`` without materialising the logits.

    Equal (within fp32 rounding, values and gradients) to
    ``token_cross_entropy(nn.functional.linear(hidden, weight, bias), target)``
    but the peak memory holds one ``(chunk_tokens, vocab)`` block of logits
    instead of all ``(tokens, vocab)``.

    Args:
        hidden: ``(N, H)`` final hidden states (after the final norm).
        weight: ``(V, H)`` LM-head weight; ``bias``: ``(V,)`` or ``None``.
        target: ``(N,)`` target token ids, already shifted; ``ignore_index`` where no loss.
        ignore_index: target value without a loss (its loss is 0).
        chunk_tokens: tokens per chunk.

    Returns:
        ``(N,)`` fp32 per-token losses.

    Raises:
        ValueError: on mismatched shapes, a bad ``chunk_tokens`` or targets outside the vocabulary.
    """
    check_int(chunk_tokens, "chunk_tokens")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"chunked_linear_cross_entropy needs hidden (N, H) and weight (V, H), got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if target.shape != hidden.shape[:1]:
        raise ValueError(
            f"target must have shape ({hidden.shape[0]},) like hidden's tokens, got {tuple(target.shape)}"
        )
    target = target.to(hidden.device)
    _check_targets(target, weight.shape[0], ignore_index)
    out = _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, target, ignore_index, chunk_tokens)
    return out
