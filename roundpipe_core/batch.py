"""Split inputs and labels into microbatches and merge outputs back (any pytree).

Tensors whose first dimension is the batch size are split along dim 0 into
near-equal parts (sizes differ by at most one); every other leaf (non-tensors,
scalars, tensors of another leading size) is broadcast to every microbatch.
Containers may be tuples, lists, dicts, namedtuples, anything registered with
``torch.utils._pytree`` (Hugging Face ``ModelOutput`` is) and dataclasses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

Rebuild = Callable[[list[Any]], Any]


def flatten(obj: Any) -> tuple[list[Any], Rebuild]:
    """Flatten ``obj`` into leaves and a function that rebuilds it from new leaves."""
    if isinstance(obj, torch.Tensor):
        return [obj], lambda leaves: leaves[0]
    if type(obj) in pytree.SUPPORTED_NODES:
        children, ctx = pytree.SUPPORTED_NODES[type(obj)].flatten_fn(obj)
        return _flatten_children(
            list(children), lambda kids: pytree.SUPPORTED_NODES[type(obj)].unflatten_fn(kids, ctx)
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if f.init]
        children = [getattr(obj, n) for n in names]
        return _flatten_children(
            children, lambda kids: dataclasses.replace(obj, **dict(zip(names, kids)))
        )
    return [obj], lambda leaves: leaves[0]


def _flatten_children(
    children: list[Any], build: Callable[[list[Any]], Any]
) -> tuple[list[Any], Rebuild]:
    parts = [flatten(c) for c in children]
    counts = [len(p[0]) for p in parts]
    leaves = [leaf for p in parts for leaf in p[0]]

    def rebuild(new_leaves: list[Any]) -> Any:
        kids, pos = [], 0
        for (_, rb), n in zip(parts, counts):
            kids.append(rb(new_leaves[pos : pos + n]))
            pos += n
        return build(kids)

    return leaves, rebuild


def batch_size_of(obj: Any) -> int | None:
    """Leading size of the first tensor leaf with at least one dimension."""
    for leaf in flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def split_sizes(batch_size: int | None, num_microbatch: int) -> list[int]:
    """Near-equal microbatch sizes; fewer microbatches when the batch is smaller."""
    if num_microbatch < 1:
        raise ValueError(f"num_microbatch must be >= 1, got {num_microbatch}")
    if batch_size is None:
        return [0]  # nothing to split: one microbatch, everything broadcast
    if batch_size == 0:
        raise ValueError("cannot run an empty batch (batch size 0)")
    m = min(num_microbatch, batch_size)
    base, extra = divmod(batch_size, m)
    return [base + (1 if i < extra else 0) for i in range(m)]


def split_tree(obj: Any, sizes: list[int], batch_size: int | None) -> list[Any]:
    """Split every batch-leading tensor of ``obj`` by ``sizes``; broadcast the rest."""
    leaves, rebuild = flatten(obj)
    per_leaf = []
    for leaf in leaves:
        if (
            batch_size is not None
            and isinstance(leaf, torch.Tensor)
            and leaf.dim() >= 1
            and leaf.shape[0] == batch_size
        ):
            per_leaf.append(list(torch.split(leaf, sizes, dim=0)))
        else:
            per_leaf.append([leaf] * len(sizes))
    return [rebuild([parts[i] for parts in per_leaf]) for i in range(len(sizes))]


def default_split_input(args: tuple, kwargs: dict, num_microbatch: int) -> list[tuple[tuple, dict]]:
    """Split positional and keyword inputs into at most ``num_microbatch`` microbatches."""
    bs = batch_size_of((args, kwargs))
    sizes = split_sizes(bs, num_microbatch)
    return [tuple(x) for x in split_tree((args, kwargs), sizes, bs)]


def default_split_label(label: Any, num_microbatch: int) -> list[Any]:
    """Split labels the same way as inputs (by their own leading size)."""
    bs = batch_size_of(label)
    return split_tree(label, split_sizes(bs, num_microbatch), bs)


def default_merge_output(outputs: list[Any]) -> Any:
    """Concatenate batch-leading tensors along dim 0; sum 0-dim tensors (per-microbatch
    scalars such as losses); keep the first microbatch's value for non-tensors."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [flatten(o) for o in outputs]
    n = len(flat[0][0])
    if any(len(f[0]) != n for f in flat):
        raise ValueError(
            "microbatch outputs have different structures; give a merge_output function"
        )
    merged = []
    for i in range(n):
        vals = [f[0][i] for f in flat]
        v0 = vals[0]
        if isinstance(v0, torch.Tensor):
            merged.append(torch.stack(vals).sum(0) if v0.dim() == 0 else torch.cat(vals, dim=0))
        else:
            merged.append(v0)
    return flat[0][1](merged)
