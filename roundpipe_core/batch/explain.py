"""Saying how the automatic split cut a call's inputs, for the error of a layer.

The automatic split cuts *every* tensor whose first dimension is the batch size, also
one only as long by chance (a per-feature vector of 8 values with batch 8), and the
layer that receives a slice fails with a shape error that never mentions the split:
:func:`auto_split_note` says what was cut, for the runtime to add to such an error.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .tree import _children

__all__ = ["AutoSplitLeaf", "auto_split_note", "leaf_paths"]


class AutoSplitLeaf(NamedTuple):
    """One input leaf the automatic split cut along dim 0."""

    path: str  # where it is in the call's inputs: "args[1]", "kwargs['scale']"
    shape: tuple[int, ...]  # before the split
    sizes: tuple[int, ...]  # its length in each microbatch


def leaf_paths(obj: Any, where: str) -> list[str]:
    """The path of every leaf of ``obj`` in ``flatten`` order (``where`` is the root)."""
    node = _children(obj)  # (None for a tensor or packed data: a leaf)
    if node is None:
        return [where]
    kids, _, keys = node
    names = keys if keys is not None else list(range(len(kids)))
    return [p for k, kid in zip(names, kids) for p in leaf_paths(kid, f"{where}[{k!r}]")]


def auto_split_note(cut: tuple[AutoSplitLeaf, ...], limit: int = 6) -> str | None:
    """A note for a layer's error when the automatic split cut more than the first
    tensor (whose length is the batch size); ``None`` when there is nothing to doubt."""
    if len(cut) < 2:
        return None
    first, rest = cut[0], cut[1:]
    pieces = "; ".join(
        f"{leaf.path} {tuple(leaf.shape)} -> "
        + " ".join(str((s, *leaf.shape[1:])) for s in leaf.sizes)
        for leaf in rest[:limit]
    )
    more = f"; and {len(rest) - limit} more" if len(rest) > limit else ""
    return (
        f"RoundPipe: the inputs were split into microbatches automatically (split_input=None): "
        f"the batch size is {first.shape[0]}, from {first.path} {tuple(first.shape)}, and every "
        f"other tensor whose first dimension is {first.shape[0]} was cut along it too: "
        f"{pieces}{more}. If one of these is not per-sample (say, a per-feature tensor as long "
        "as the batch), give a split_input spec that passes it whole: "
        "RoundPipeRunConfig(split_input=(args_spec, kwargs_spec)), structures that mirror the "
        "inputs with Replicate (roundpipe_core.batch) at that leaf and None (automatic) "
        "elsewhere, e.g. ((None, Replicate), {}) for args[1] of two positional inputs "
        "(user guide, 'Run configuration')."
    )
