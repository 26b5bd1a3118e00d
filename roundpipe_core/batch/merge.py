"""Merge per-microbatch outputs (automatic, specs, a function, or kept apart) and
send the merged output's gradients back to the microbatches."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .tree import (
    RoundPipePackedData,
    _chunk_dim,
    _is_chunk,
    _is_reducer,
    _is_replicate,
    _leaf_specs,
    _SumReducer,
    flatten,
)

__all__ = [
    "MergedOutputs",
    "merge_outputs",
    "merge_outputs_with_grad",
    "sum_merge_output",
]


class MergedOutputs(NamedTuple):
    """Merged outputs and how each tensor leaf was merged (for the backward).

    ``leaf_rules[i]`` is ``("cat", dim, sizes)``, ``("mean", n)``, ``("sum",)``,
    ``("first",)`` (replicated) or ``("none",)`` (no gradient path), per leaf of
    ``flatten(merged)``.
    """

    merged: Any
    leaf_rules: list[tuple] | None
    num_microbatch: int = 1

    def split_output_grads(self, grads: list[torch.Tensor | None]) -> list[list[Any]]:
        """Per microbatch, one gradient per output leaf from ``grads`` (one per leaf of
        ``flatten(merged)``, or ``None``): the slice of a concatenation, ``g / n`` for an
        average, ``g`` for a sum, ``g`` to microbatch 0 only for a replicated value."""
        if self.leaf_rules is None:
            raise ValueError(
                "outputs merged by a custom merge_output function cannot be differentiated "
                "through; use a merge spec, or use the function for inference"
            )
        n = self.num_microbatch
        out: list[list[Any]] = [[] for _ in range(n)]
        for g, rule in zip(grads, self.leaf_rules):
            if g is None or rule[0] == "none":
                parts: list[Any] = [None] * n
            elif rule[0] == "cat":
                parts = list(torch.split(g, list(rule[2]), dim=rule[1]))
            elif rule[0] == "mean":
                parts = [g / rule[1]] * n
            elif rule[0] == "sum":
                parts = [g] * n
            else:  # first
                parts = [g] + [None] * (n - 1)
            for i in range(n):
                out[i].append(parts[i])
        return out


def merge_outputs(merge_output: Any, outputs: list[Any]) -> Any:
    """Merge the per-microbatch outputs as ``merge_output`` says (:mod:`roundpipe_core.batch`)."""
    return merge_outputs_with_grad(merge_output, outputs).merged


def merge_outputs_with_grad(merge_output: Any, outputs: list[Any]) -> MergedOutputs:
    """:func:`merge_outputs` that also says how to send gradients back per microbatch."""
    if not outputs:
        raise ValueError("no microbatch outputs to merge")
    n = len(outputs)
    if merge_output is False:
        packed = [RoundPipePackedData(vals) for vals in _per_leaf(outputs)]
        return MergedOutputs(flatten(outputs[0])[1](packed), None, n)
    if callable(merge_output):
        return MergedOutputs(merge_output(list(outputs)), None, n)
    automatic = merge_output is None or merge_output is True
    spec_leaves = None if automatic else _leaf_specs(merge_output, outputs[0], "merge_output")
    if n == 1:
        leaves, _ = flatten(outputs[0])
        rules = [("first",) if isinstance(x, torch.Tensor) else ("none",) for x in leaves]
        return MergedOutputs(outputs[0], rules, 1)
    rebuild = flatten(outputs[0])[1]
    merged, rules = [], []
    for i, vals in enumerate(_per_leaf(outputs)):
        m, w = spec_leaves[i] if spec_leaves is not None else (None, f"output leaf {i}")
        value, rule = _merge_leaf(vals, m, w)
        merged.append(value)
        rules.append(rule)
    return MergedOutputs(rebuild(merged), rules, n)


def _per_leaf(outputs: list[Any]) -> list[list[Any]]:
    """Per leaf of the outputs' common structure, its value in each microbatch."""
    flat = [flatten(o)[0] for o in outputs]
    if any(len(f) != len(flat[0]) for f in flat):
        raise ValueError(
            "microbatch outputs have different structures; give a merge_output function"
        )
    return [list(vals) for vals in zip(*flat)]


def _merge_leaf(vals: list[Any], marker: Any, where: str) -> tuple[Any, tuple]:
    v0 = vals[0]
    n = len(vals)
    if marker is None:  # automatic
        if isinstance(v0, torch.Tensor):
            if v0.dim() == 0:
                return _mean(vals), ("mean", n)
            return torch.cat(vals, dim=0), ("cat", 0, tuple(int(v.shape[0]) for v in vals))
        return _replicated(vals, where), ("none",)
    if _is_chunk(marker):
        dim = _chunk_dim(marker, v0, where)
        return torch.cat(vals, dim=dim), ("cat", dim, tuple(int(v.shape[dim]) for v in vals))
    if _is_replicate(marker):
        value = _replicated(vals, where)
        return value, (("first",) if isinstance(v0, torch.Tensor) else ("none",))
    if isinstance(marker, _SumReducer) and marker.mean:
        return _mean(vals), ("mean", n)
    if isinstance(marker, _SumReducer):
        return torch.stack(vals).sum(0) if isinstance(v0, torch.Tensor) else sum(vals), ("sum",)
    if _is_reducer(marker):
        acc = marker.init_value
        for v in vals:
            acc = marker.reduce_fn(acc, v)
        return acc, ("none",)
    raise TypeError(
        f"{marker!r} is not a merge marker ({where}); use TensorChunkSpec(dim), Replicate, "
        "a reducer or None"
    )


def _mean(vals: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(vals)
    if not (stacked.is_floating_point() or stacked.is_complex()):
        stacked = stacked.to(torch.get_default_dtype())  # an average of counts is fractional
    return stacked.mean(0)


def _replicated(vals: list[Any], where: str) -> Any:
    v0 = vals[0]
    for v in vals[1:]:
        same = (
            isinstance(v, torch.Tensor) and v.shape == v0.shape and bool(torch.equal(v, v0))
            if isinstance(v0, torch.Tensor)
            else _safe_eq(v, v0)
        )
        if not same:
            raise ValueError(
                f"{where} differs between microbatches ({v0!r} vs {v!r}) and cannot be "
                "merged as replicated; give a merge_output spec or function for it"
            )
    return v0


def _safe_eq(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable == are compared by identity
        return a is b


def sum_merge_output(outputs: list[Any]) -> Any:
    """Concatenate batch-leading tensors along dim 0, **sum** 0-dim tensors and keep the
    first microbatch's value for non-tensors: for per-microbatch sums (a loss summed
    over tokens, a token count) whose total is wanted rather than their average."""
    if len(outputs) == 1:
        return outputs[0]
    merged = []
    for vals in _per_leaf(outputs):
        v0 = vals[0]
        if isinstance(v0, torch.Tensor):
            merged.append(torch.stack(vals).sum(0) if v0.dim() == 0 else torch.cat(vals, dim=0))
        else:
            merged.append(v0)
    return flatten(outputs[0])[1](merged)
