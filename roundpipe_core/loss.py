"""The loss of a ``forward_backward`` call: the default ``loss_fn``, how the per-microbatch
losses combine (``loss_reduction``: each microbatch's weight) and the user's ``loss_fn``
called so that an error it raises says where it came from."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "LOSS_REDUCTIONS",
    "batch_normalized",
    "call_loss_fn",
    "check_loss_reduction",
    "default_loss_fn",
    "microbatch_loss_weights",
]


def call_loss_fn(
    loss_fn: Callable[[Any, Any], torch.Tensor] | None, out: Any, label: Any, mb: int, device: Any
) -> torch.Tensor:
    """``loss_fn(out, label)``; an error it raises says it came from the loss function
    (not from the layers of the fused stage), with the microbatch."""
    assert loss_fn is not None
    try:
        return loss_fn(out, label)
    except BaseException as exc:
        if hasattr(exc, "add_note"):
            name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
            exc.add_note(
                f"RoundPipe: raised in the loss function ({name}), microbatch {mb}, "
                f"on device {device.index} ({device.device})"
            )
        raise


def default_loss_fn(outputs: Any, labels: Any) -> Any:
    """``forward_backward``'s default loss: the model's output is the loss."""
    return outputs


#: how ``forward_backward`` combines its per-microbatch losses: "sum" (the published
#: contract) or "mean" (each weighted by its share of the batch rows)
LOSS_REDUCTIONS = ("sum", "mean")


def check_loss_reduction(value: Any, name: str = "loss_reduction") -> str:
    """``value`` if it is one of :data:`LOSS_REDUCTIONS` (a clear error otherwise)."""
    if not isinstance(value, str) or value not in LOSS_REDUCTIONS:
        raise ValueError(
            f"{name} must be 'sum' (the per-microbatch losses are added up) or 'mean' (each "
            f"microbatch loss is weighted by its share of the batch, so a loss_fn returning a "
            f"batch mean gives the whole batch's mean), got {value!r}"
        )
    return value


_LossFn = Callable[[Any, Any], Any]


def batch_normalized(loss_fn: _LossFn) -> _LossFn:
    """Mark ``loss_fn`` as already returning its microbatch's share of the whole batch's loss
    (it divides by a count over the whole batch, as ``causal_lm_loss_fn`` does): under
    ``loss_reduction="mean"`` its losses are then added up, not weighted a second time."""
    setattr(loss_fn, "batch_normalized", True)  # noqa: B010 -- a function takes no annotation
    return loss_fn


def microbatch_loss_weights(
    reduction: str, loss_fn: Any, sizes: list[int], batch_size: int | None, num_microbatch: int
) -> list[float] | None:
    """The factor on each microbatch's loss (returned and backpropagated), or ``None``.

    ``None`` under ``"sum"`` or for a :func:`batch_normalized` loss_fn. Under ``"mean"``:
    microbatch rows / batch rows, as the batch was split; a split that does not report rows
    (a custom ``split_input`` function, a split along another dim) weights them equally.
    """
    if reduction == "sum" or getattr(loss_fn, "batch_normalized", False) is True:
        return None
    if batch_size and len(sizes) == num_microbatch:
        return [n / batch_size for n in sizes]
    return [1.0 / num_microbatch] * num_microbatch
