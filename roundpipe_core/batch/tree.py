"""Pytrees of a call's values, packed per-microbatch data and the split/merge spec markers."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "RoundPipePackedData",
    "TensorChunkSpec",
    "Replicate",
    "Reducer",
    "avg_reducer",
    "sum_reducer",
    "flatten",
    "batch_extent",
    "batch_size_of",
    "split_sizes",
    "split_tree",
    "check_run_specs",
    "spec_pair",
]

Rebuild = Callable[[list[Any]], Any]

# torch.distributed.pipelining's markers (what the published RoundPipe documents) are
# accepted too, never imported (it costs seconds): a spec built from them means it is loaded.
_TORCH_MB = "torch.distributed.pipelining.microbatch"


class TensorChunkSpec:
    """Split a tensor into microbatches along ``split_dim`` (merge: concatenate along it)."""

    def __init__(self, split_dim: int) -> None:
        if not isinstance(split_dim, int) or isinstance(split_dim, bool):
            raise TypeError(f"split_dim must be an int, got {split_dim!r}")
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"


class Replicate:
    """Marker (the class or an instance): the subtree goes whole to every microbatch
    (merge: it must be equal in every microbatch)."""

    def __repr__(self) -> str:
        return "Replicate"


class Reducer:
    """Merge marker: fold the microbatch values, ``acc = reduce_fn(acc, value)`` from
    ``init_value`` (torch's ``_CustomReducer`` is accepted as well)."""

    def __init__(self, init_value: Any, reduce_fn: Callable[[Any, Any], Any]) -> None:
        self.init_value = init_value
        self.reduce_fn = reduce_fn


def _torch_marker(spec: Any, name: str) -> bool:
    mod = sys.modules.get(_TORCH_MB)
    if mod is None:
        return False
    cls = getattr(mod, name, None)
    return cls is not None and (spec is cls or isinstance(spec, cls))


def _is_chunk(spec: Any) -> bool:
    return isinstance(spec, TensorChunkSpec) or (
        not isinstance(spec, type) and _torch_marker(spec, "TensorChunkSpec")
    )


def _is_reducer(spec: Any) -> bool:
    return isinstance(spec, Reducer) or (
        not isinstance(spec, type) and _torch_marker(spec, "_CustomReducer")
    )


class RoundPipePackedData(list):
    """The per-microbatch values of one output leaf, kept apart (``merge_output=False``).
    As an input (or label) leaf of a call, microbatch ``i`` gets element ``i`` and other
    batch tensors are split with the same sizes.

    Args:
        data: one value per microbatch.
        transfer_event: per microbatch, ``(forward_event, backward_event)`` that signal
            the value (and its gradient) reached the host; ``None`` where nothing is in
            flight (CPU workers copy synchronously).
    """

    def __init__(self, data: Sequence[Any] = (), transfer_event: Sequence[Any] | None = None):
        super().__init__(data)
        self.transfer_event: list[Any] = list(transfer_event or [])

    def synchronize(self) -> None:
        """Wait until every microbatch value has reached host memory."""
        for fwd, _bwd in self.transfer_event:
            if fwd is not None:
                fwd.synchronize()

    def __repr__(self) -> str:
        return f"RoundPipePackedData({list.__repr__(self)})"


class _SumReducer(Reducer):
    """Sum over microbatches, or with ``mean`` their average (which a fold cannot express)."""

    def __init__(self, mean: bool) -> None:
        super().__init__(None, lambda acc, v: v if acc is None else acc + v)
        self.mean = mean

    def __repr__(self) -> str:
        return "avg_reducer" if self.mean else "sum_reducer"


avg_reducer = _SumReducer(mean=True)
sum_reducer = _SumReducer(mean=False)


def _children(obj: Any) -> tuple[list[Any], Callable[[list[Any]], Any], list[Any] | None] | None:
    """One level of ``obj``: (children, rebuild, dict keys or None), or None for a leaf."""
    if isinstance(obj, (torch.Tensor, RoundPipePackedData)):
        return None
    if type(obj) in pytree.SUPPORTED_NODES:
        node = pytree.SUPPORTED_NODES[type(obj)]
        kids, ctx = node.flatten_fn(obj)
        keys = list(obj.keys()) if isinstance(obj, dict) else None
        return list(kids), lambda new: node.unflatten_fn(new, ctx), keys
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if f.init]
        return (
            [getattr(obj, n) for n in names],
            lambda new: dataclasses.replace(obj, **dict(zip(names, new))),
            None,
        )
    return None


def flatten(obj: Any) -> tuple[list[Any], Rebuild]:
    """Flatten ``obj`` into leaves and a function that rebuilds it from new leaves."""
    node = _children(obj)
    if node is None:
        return [obj], lambda leaves: leaves[0]
    children, build, _ = node
    parts = [flatten(c) for c in children]
    counts = [len(p[0]) for p in parts]

    def rebuild(new_leaves: list[Any]) -> Any:
        kids, pos = [], 0
        for (_, rb), n in zip(parts, counts):
            kids.append(rb(new_leaves[pos : pos + n]))
            pos += n
        return build(kids)

    return [leaf for p in parts for leaf in p[0]], rebuild


def batch_size_of(obj: Any) -> int | None:
    """Leading size of the first tensor leaf with at least one dimension."""
    for leaf in flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def batch_extent(args: Any, kwargs: Any) -> tuple[int, int]:
    """(samples, tokens) of a call: the first input tensor's leading dimension and, for
    integer token ids (two or more dims), its number of elements (else 0)."""
    stack: list[Any] = [args, kwargs]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            samples = int(x.shape[0]) if x.dim() > 0 else 1
            integral = not (x.is_floating_point() or x.is_complex())
            return samples, (x.numel() if integral and x.dim() >= 2 else 0)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return 0, 0


def _batch_leading(x: Any, batch_size: int | None) -> bool:
    """Whether ``x`` is a tensor whose first dimension is ``batch_size``."""
    return isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch_size


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
    per_leaf = [
        list(torch.split(x, sizes, dim=0)) if _batch_leading(x, batch_size) else [x] * len(sizes)
        for x in leaves
    ]
    return [rebuild([parts[i] for parts in per_leaf]) for i in range(len(sizes))]


def _is_replicate(spec: Any) -> bool:
    return spec is Replicate or isinstance(spec, Replicate) or _torch_marker(spec, "_Replicate")


def _is_marker(spec: Any) -> bool:
    return (
        spec is None
        or _is_replicate(spec)
        or _is_chunk(spec)
        or _is_reducer(spec)
        or isinstance(spec, bool)
    )


def _leaf_specs(spec: Any, value: Any, where: str) -> list[tuple[Any, str]]:
    """(marker, where) for every leaf of ``value`` from a spec that mirrors (a prefix of) it."""
    if _is_marker(spec):
        return [(spec, where)] * len(flatten(value)[0])
    node, snode = _children(value), _children(spec)
    if node is None or snode is None:
        raise TypeError(
            f"split/merge spec at {where} is {spec!r} but the value there is a "
            f"{type(value).__name__}; use TensorChunkSpec(dim), Replicate, a reducer or None "
            "for a leaf, or a container that mirrors the value"
        )
    kids, _, keys = node
    skids, _, skeys = snode
    if keys is not None and skeys is not None:
        by_key = dict(zip(skeys, skids))
        unknown = [k for k in skeys if k not in keys]
        if unknown:
            raise ValueError(
                f"spec at {where} names keys {unknown} that the value does not have "
                f"(its keys: {keys})"
            )
        pairs = [(by_key.get(k), kid, f"{where}[{k!r}]") for k, kid in zip(keys, kids)]
    else:
        if len(skids) != len(kids):
            raise ValueError(
                f"spec at {where} has {len(skids)} entries but the value has {len(kids)}; "
                "give one spec per element (None for automatic)"
            )
        pairs = [(s, kid, f"{where}[{i}]") for i, (s, kid) in enumerate(zip(skids, kids))]
    return [m for s, kid, w in pairs for m in _leaf_specs(s, kid, w)]


def check_run_specs(
    split_input: Any = None, split_label: Any = None, merge_output: Any = None
) -> None:
    """Check the split/merge fields of a run config when it is made, before any call.

    Raises:
        TypeError: naming the field and the offending part, with the accepted forms.
    """
    # (None, the automatic rule, passes as a marker)
    if split_input is not None and not callable(split_input):
        for i, spec in enumerate(spec_pair(split_input)):
            _check_spec_tree(spec, f"split_input[{i}]", split=True)
    if not callable(split_label):
        _check_spec_tree(split_label, "split_label", split=True)
    if not callable(merge_output) and not isinstance(merge_output, bool):
        _check_spec_tree(merge_output, "merge_output", split=False)


def spec_pair(split_input: Any) -> tuple[Any, Any]:
    """``split_input``'s ``(args_spec, kwargs_spec)``; TypeError unless it is a pair."""
    if not (isinstance(split_input, (tuple, list)) and len(split_input) == 2):
        raise TypeError(
            "split_input must be None, a function f(args, kwargs, n) or a pair "
            f"(args_spec, kwargs_spec); got {split_input!r}"
        )
    return split_input[0], split_input[1]


def _check_spec_tree(spec: Any, where: str, split: bool) -> None:
    if _is_marker(spec) and not isinstance(spec, bool):
        if split and _is_reducer(spec):
            raise TypeError(
                f"{where}: reducers merge outputs; to split use TensorChunkSpec(dim), Replicate or None"
            )
        return
    node = _children(spec)
    if node is None:
        raise TypeError(
            f"{where} is {spec!r}; a spec holds TensorChunkSpec(dim), Replicate, "
            + ("" if split else "a reducer, ")
            + "or None, in containers that mirror the value"
        )
    kids, _, keys = node
    for i, kid in enumerate(kids):
        _check_spec_tree(kid, f"{where}[{keys[i]!r}]" if keys else f"{where}[{i}]", split)


def _chunk_dim(spec: Any, leaf: Any, where: str) -> int:
    if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
        raise TypeError(
            f"TensorChunkSpec({spec.split_dim}) at {where} needs a tensor with at least one "
            f"dimension, got {type(leaf).__name__}"
            + (" of 0 dims" if isinstance(leaf, torch.Tensor) else "")
            + "; use Replicate for it"
        )
    dim = spec.split_dim if spec.split_dim >= 0 else spec.split_dim + leaf.dim()
    if not 0 <= dim < leaf.dim():
        raise ValueError(
            f"TensorChunkSpec({spec.split_dim}) at {where}: the tensor has only "
            f"{leaf.dim()} dims (shape {tuple(leaf.shape)})"
        )
    return dim
