"""What travels between the pipeline layers of a converted causal LM: the *decoder state*.

A plain tuple::

    (hidden_states, cos, sin, position_ids, attention_mask, labels, extras)

Every tensor in it has the batch as dim 0, so the engine can split
microbatches along dim 0. ``extras`` is a dict of per-call options and running
sums that only some layers read:

* ``"return_logits"`` (bool): the last layer computes the logits.
* ``"logits_to_keep"`` (int): ``k > 0``: logits of the last ``k`` positions only.
* ``"num_items_in_batch"`` (0-dim tensor or ``None``): the loss denominator.
* ``"output_router_logits"`` (bool): MoE blocks add their router sums.
* ``"router_stats"``: ``(expert_tokens, router_probs, rows)`` per-sample sums, or ``None``.

The 4D attention mask is deliberately **not** passed between layers: for long
sequences a ``(B, 1, S, S)`` mask is larger than the hidden states, so each
block rebuilds it from the 2D padding mask on its own device.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STATE_FIELDS", "DecoderState", "unpack_state"]

DecoderState = tuple[Any, ...]
STATE_FIELDS = (
    "hidden_states",
    "cos",
    "sin",
    "position_ids",
    "attention_mask",
    "labels",
    "extras",
)


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
