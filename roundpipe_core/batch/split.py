"""Cut a call's inputs and labels into microbatches (automatic, specs, or a function)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..kinds import check_int
from .explain import AutoSplitLeaf, leaf_paths
from .tree import (
    RoundPipePackedData,
    _batch_leading,
    _chunk_dim,
    _is_chunk,
    _is_reducer,
    _is_replicate,
    _leaf_specs,
    batch_size_of,
    flatten,
    spec_pair,
    split_sizes,
    split_tree,
)

__all__ = ["SplitInputs", "split_call_inputs", "split_call_labels", "default_split_input"]


class _LeafRule(NamedTuple):
    """How one tensor leaf was cut (its adjoint joins the per-microbatch gradients)."""

    kind: str  # "chunk" | "replicate" | "packed"
    dim: int = 0
    sizes: tuple[int, ...] = ()


class SplitInputs(NamedTuple):
    """A call's inputs cut into microbatches.

    Attributes:
        parts: ``[(args, kwargs), ...]``, one per microbatch.
        sizes: batch rows per microbatch along dim 0 when the split was by batch rows
            (automatic, or packed data); ``[]`` when a function or other dims decided.
        batch_size: the batch size those sizes add up to, or ``None``.
        leaf_rules: per leaf of ``flatten((args, kwargs))``, how it was cut; ``None``
            when a custom function split the inputs.
        auto_cut: the leaves the automatic rule (no spec) cut along dim 0, in order
            (the first gave the batch size); what a layer's error reports
            (:func:`~roundpipe_core.batch.explain.auto_split_note`).
    """

    parts: list[tuple[tuple, dict]]
    sizes: list[int]
    batch_size: int | None
    leaf_rules: list[_LeafRule] | None
    auto_cut: tuple[AutoSplitLeaf, ...] = ()

    def join_input_grads(self, per_microbatch: list[list[torch.Tensor | None]]) -> list[Any]:
        """One gradient (or ``None``) per leaf of the original ``(args, kwargs)`` from each
        microbatch's input-leaf gradients (``flatten`` order): chunks concatenated back,
        replicated leaves summed."""
        if self.leaf_rules is None:
            raise ValueError(
                "inputs split by a custom split_input function cannot take a gradient: their "
                "microbatch leaves do not map back to the input; use a split spec instead"
            )
        out: list[Any] = []
        for i, rule in enumerate(self.leaf_rules):
            parts = [g[i] if i < len(g) else None for g in per_microbatch]
            if all(p is None for p in parts):
                out.append(None)
            elif rule.kind == "chunk":
                ref = next(p for p in parts if p is not None)
                full = [
                    p
                    if p is not None
                    else ref.new_zeros((*ref.shape[: rule.dim], s, *ref.shape[rule.dim + 1 :]))
                    for p, s in zip(parts, rule.sizes)
                ]
                out.append(torch.cat(full, dim=rule.dim))
            elif rule.kind == "replicate":
                out.append(torch.stack([p for p in parts if p is not None]).sum(0))
            else:  # packed: one value per microbatch, kept apart
                out.append(RoundPipePackedData(parts))
        return out


def _split_leaves(
    leaves: list[Any], marked: list[tuple[Any, str]], num_microbatch: int, where: str
) -> tuple[list[list[Any]], list[_LeafRule], list[int], int | None]:
    """Cut each leaf by its marker; returns per-microbatch leaves, rules, row sizes, batch."""
    markers = [m for m, _ in marked]
    places = [w for _, w in marked]
    packed = [x for x in leaves if isinstance(x, RoundPipePackedData)]
    if packed:
        lens = {len(p) for p in packed}
        if len(lens) != 1 or 0 in lens:
            raise ValueError(
                f"packed inputs ({where}) hold different or zero numbers of microbatches: "
                f"{sorted(lens)}; pass outputs of calls that ran the same number"
            )
    # automatic leaves: batch size from the first auto tensor, or from the packed data
    auto = [x for x, m in zip(leaves, markers) if m is None]
    bs = batch_size_of(auto)
    sizes: list[int] | None = None
    if packed:
        n = len(packed[0])
        if all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in packed[0]):
            sizes = [int(v.shape[0]) for v in packed[0]]
        bs = sum(sizes) if sizes is not None else None
    else:
        dims = [
            int(x.shape[d])
            for x, m, w in zip(leaves, markers, places)
            if _is_chunk(m) and (d := _chunk_dim(m, x, w)) >= 0
        ]
        cap = min([num_microbatch, *dims] + ([bs] if bs is not None else []))
        if cap < 1:
            raise ValueError(f"cannot split an empty batch ({where})")
        n = cap if (dims or bs is not None) else 1
        if bs is not None:
            sizes = split_sizes(bs, n)
    per_mb: list[list[Any]] = [[] for _ in range(n)]
    rules: list[_LeafRule] = []
    for x, m, w in zip(leaves, markers, places):
        if isinstance(x, RoundPipePackedData):
            chunks, rule = list(x), _LeafRule("packed")
        elif _is_chunk(m):
            dim = _chunk_dim(m, x, w)
            chunks = list(torch.tensor_split(x, n, dim=dim))
            rule = _LeafRule("chunk", dim, tuple(int(c.shape[dim]) for c in chunks))
        elif m is None and sizes is not None and _batch_leading(x, bs):
            chunks = list(torch.split(x, sizes, dim=0))
            rule = _LeafRule("chunk", 0, tuple(sizes))
        elif m is None or _is_replicate(m):
            chunks, rule = [x] * n, _LeafRule("replicate")
        else:
            raise TypeError(
                f"{m!r} is not a split marker ({w}); use TensorChunkSpec(dim), Replicate or None"
            )
        for i in range(n):
            per_mb[i].append(chunks[i])
        rules.append(rule)
    return per_mb, rules, sizes or [], (bs if sizes is not None else None)


def split_call_inputs(
    split_input: Any, args: tuple, kwargs: dict, num_microbatch: int
) -> SplitInputs:
    """Cut a call's ``(args, kwargs)`` into ``num_microbatch`` microbatches (fewer when the
    batch is smaller; packed inputs decide themselves) as ``split_input`` says: ``None``
    (automatic), ``(args_spec, kwargs_spec)``, or a function ``f(args, kwargs, n)``.

    Raises:
        TypeError / ValueError: on a malformed spec or function result, naming it.
    """
    check_int(num_microbatch, "num_microbatch")
    args, kwargs = tuple(args), dict(kwargs)
    if callable(split_input):
        parts = _normalise_split_result(split_input(args, kwargs, num_microbatch))
        parts = [_take_packed(part, i, len(parts)) for i, part in enumerate(parts)]
        return SplitInputs([(tuple(a), dict(k)) for a, k in parts], [], None, None)
    args_spec, kwargs_spec = (None, None) if split_input is None else spec_pair(split_input)
    markers = _leaf_specs(args_spec, args, "args") + _leaf_specs(kwargs_spec, kwargs, "kwargs")
    if any((_is_reducer(m) or isinstance(m, bool)) for m, _ in markers):
        raise TypeError(
            "reducers are merge specs; split_input takes TensorChunkSpec, Replicate, None"
        )
    leaves, rebuild = flatten((args, kwargs))
    per_mb, rules, sizes, bs = _split_leaves(leaves, markers, num_microbatch, "split_input")
    parts = [rebuild(mb) for mb in per_mb]
    paths = leaf_paths(args, "args") + leaf_paths(kwargs, "kwargs")
    auto_cut = tuple(
        AutoSplitLeaf(path, tuple(x.shape), rule.sizes)
        for x, (m, _), rule, path in zip(leaves, markers, rules, paths)
        if m is None and rule.kind == "chunk"
    )
    return SplitInputs([(tuple(a), dict(k)) for a, k in parts], sizes, bs, rules, auto_cut)


def _normalise_split_result(result: Any) -> list[tuple[tuple, dict]]:
    """Accept ``(args_list, kwargs_list)`` and ``[(args, kwargs), ...]`` unambiguously."""
    what = f"split_input returned {type(result).__name__}"
    if not isinstance(result, (tuple, list)):
        raise TypeError(f"{what}; return (args_list, kwargs_list) or [(args, kwargs), ...]")
    # (args_list, kwargs_list): two sequences, the second all dicts. A list of
    # (args, kwargs) pairs never looks like that: its second pair starts with a tuple.
    if (
        len(result) == 2
        and all(isinstance(x, (tuple, list)) for x in result)
        and all(isinstance(k, dict) for k in result[1])
    ):
        args_list, kwargs_list = result
        if len(args_list) != len(kwargs_list):
            raise ValueError(
                f"split_input returned {len(args_list)} args but {len(kwargs_list)} kwargs; "
                "both lists need one entry per microbatch"
            )
        pairs = list(zip(args_list, kwargs_list))
    else:
        pairs = list(result)
        for i, p in enumerate(pairs):
            if not (isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], dict)):
                raise TypeError(
                    f"split_input returned {type(p).__name__} for microbatch {i}; return "
                    "(args_list, kwargs_list) or [(args_tuple, kwargs_dict), ...]"
                )
    if not pairs:
        raise ValueError("split_input returned no microbatches")
    for i, (a, _) in enumerate(pairs):  # (both forms checked the kwargs are dicts)
        if not isinstance(a, (tuple, list)):
            raise TypeError(
                f"split_input: the args of microbatch {i} are a {type(a).__name__}, not a tuple"
            )
    return [(tuple(a), dict(k)) for a, k in pairs]


def _take_packed(value: Any, i: int, n: int | None = None) -> Any:
    """``value`` with element ``i`` of each packed leaf (checked to hold ``n``)."""
    leaves, rebuild = flatten(value)
    if not any(isinstance(x, RoundPipePackedData) for x in leaves):
        return value
    for x in leaves:
        if isinstance(x, RoundPipePackedData) and n is not None and len(x) != n:
            raise ValueError(f"packed input holds {len(x)} microbatches but split_input made {n}")
    return rebuild([x[i] if isinstance(x, RoundPipePackedData) else x for x in leaves])


def split_call_labels(
    split_label: Any,
    label: Any,
    num_parts: int,
    sizes: list[int] | None = None,
    batch_size: int | None = None,
) -> list[Any]:
    """Cut ``label`` into exactly ``num_parts`` microbatches (those of the inputs) as
    ``split_label`` says (``None``, a spec, or ``f(label, n)``); ``sizes`` / ``batch_size``:
    the inputs' row split, so automatic label rows match input rows.

    Raises:
        ValueError: when the labels cannot be cut into ``num_parts`` parts.
    """
    if callable(split_label):
        labels = split_label(label, num_parts)
        if not isinstance(labels, (list, tuple)):
            raise TypeError(
                f"split_label returned {type(labels).__name__}; return a list with one label "
                "per microbatch"
            )
        labels = list(labels)
    elif num_parts == 1:
        labels = [_take_packed(label, 0)]
    elif split_label is None and sizes and len(sizes) == num_parts:
        if any(isinstance(x, RoundPipePackedData) for x in flatten(label)[0]):
            labels = _split_marked(label, None, num_parts)
        else:
            labels = split_tree(label, sizes, batch_size)
    else:
        labels = _split_marked(label, split_label, num_parts)
    if len(labels) != num_parts:
        raise ValueError(
            f"split_label gave {len(labels)} label parts for {num_parts} microbatches; "
            "labels and inputs must split into the same number of microbatches"
        )
    return labels


def _split_marked(label: Any, spec: Any, n: int) -> list[Any]:
    markers = _leaf_specs(spec, label, "label")
    leaves, rebuild = flatten(label)
    per_mb, _, _, _ = _split_leaves(leaves, markers, n, "split_label")
    if len(per_mb) != n:
        if all(m is None for m, _ in markers) and len(per_mb) == 1 and batch_size_of(label) is None:
            return [label] * n  # nothing to split: every microbatch sees the same label
        raise ValueError(
            f"labels split into {len(per_mb)} parts but the inputs into {n}; give a "
            "split_label spec or function that cuts them alike"
        )
    return [rebuild(mb) for mb in per_mb]


def default_split_input(args: tuple, kwargs: dict, num_microbatch: int) -> list[tuple[tuple, dict]]:
    """Split positional and keyword inputs into at most ``num_microbatch`` microbatches."""
    return split_call_inputs(None, args, kwargs, num_microbatch).parts
