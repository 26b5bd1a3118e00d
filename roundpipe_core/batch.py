"""Split inputs and labels into microbatches and merge outputs back (any pytree).

Three ways to say how a call is cut into microbatches (``RoundPipeRunConfig``):

* **automatic** (``None``): tensors whose first dimension is the batch size are
  split along dim 0 into near-equal parts (sizes differ by at most one, larger
  first, as ``torch.tensor_split``); every other leaf (non-tensors, 0-dim
  tensors, tensors of another leading size) is replicated to every microbatch.
* **specs**: a structure that mirrors the value, whose leaves are
  ``TensorChunkSpec(dim)`` (split along ``dim``), ``Replicate`` (``_Replicate``,
  class or instance: the whole subtree goes to every microbatch) or ``None``
  (automatic for that subtree). ``split_input`` takes ``(args_spec,
  kwargs_spec)``; a dict spec may name only some keys.
* **a function**: ``split_input(args, kwargs, n)`` returning either
  ``(args_list, kwargs_list)`` (the published RoundPipe's contract) or
  ``[(args, kwargs), ...]``; ``split_label(label, n) -> [label, ...]``.

Merging (``merge_output``): ``None``/``True`` concatenates tensors along dim 0,
**averages** 0-dim tensors over the microbatches and keeps non-tensors that
are equal in every microbatch; a spec structure uses ``TensorChunkSpec(dim)``
(concatenate along ``dim``), ``Replicate`` (equal in every microbatch) or a
reducer (``avg_reducer``, ``sum_reducer``, any ``_CustomReducer``); a function
gets the list of outputs; ``False`` returns every leaf as a
:class:`RoundPipePackedData` of its per-microbatch values, which a following
RoundPipe call takes as already split.

Containers may be tuples, lists, dicts, namedtuples, anything registered with
``torch.utils._pytree`` (Hugging Face ``ModelOutput`` is) and dataclasses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate
from torch.utils import _pytree as pytree

__all__ = [
    "RoundPipePackedData",
    "TensorChunkSpec",
    "Replicate",
    "avg_reducer",
    "sum_reducer",
    "SplitInputs",
    "MergedOutputs",
    "flatten",
    "batch_size_of",
    "split_sizes",
    "split_tree",
    "split_call_inputs",
    "split_call_labels",
    "merge_outputs",
    "merge_outputs_with_grad",
    "default_split_input",
    "default_split_label",
    "default_merge_output",
    "sum_merge_output",
]

Rebuild = Callable[[list[Any]], Any]
#: The published RoundPipe (and torch.distributed.pipelining) spell the replicate marker
#: ``_Replicate``; both the class and an instance are accepted.
Replicate = _Replicate


# --------------------------------------------------------------------------- packed data
class RoundPipePackedData(list):
    """The per-microbatch values of one output leaf, kept apart (``merge_output=False``).

    Given as an input (or label) leaf to a RoundPipe call, it is moved and split as a
    whole: microbatch ``i`` gets element ``i``, the call runs ``len(data)`` microbatches,
    and other batch tensors are split with the same sizes so rows stay aligned.

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


# --------------------------------------------------------------------------- reducers
class _MeanReducer(_CustomReducer):
    """Average over microbatches (a fold cannot express a mean, so merging treats it
    as sum then divide; its gradient is ``g / n`` per microbatch)."""

    def __init__(self) -> None:
        super().__init__(None, lambda acc, v: v if acc is None else acc + v)

    def __repr__(self) -> str:
        return "avg_reducer"


class _SumReducer(_CustomReducer):
    """Sum over microbatches (gradient ``g`` to every microbatch)."""

    def __init__(self) -> None:
        super().__init__(None, lambda acc, v: v if acc is None else acc + v)

    def __repr__(self) -> str:
        return "sum_reducer"


avg_reducer = _MeanReducer()
sum_reducer = _SumReducer()


# --------------------------------------------------------------------------- pytrees
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


# --------------------------------------------------------------------------- specs
def _is_replicate(spec: Any) -> bool:
    return spec is _Replicate or isinstance(spec, _Replicate)


def _is_marker(spec: Any) -> bool:
    return (
        spec is None
        or _is_replicate(spec)
        or isinstance(spec, (TensorChunkSpec, _CustomReducer))
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
    """

    parts: list[tuple[tuple, dict]]
    sizes: list[int]
    batch_size: int | None
    leaf_rules: list[_LeafRule] | None

    def join_input_grads(self, per_microbatch: list[list[torch.Tensor | None]]) -> list[Any]:
        """Gradients w.r.t. the original input leaves from per-microbatch leaf gradients.

        Args:
            per_microbatch: for each microbatch, the gradients of its input leaves
                (``flatten`` order of that microbatch's ``(args, kwargs)``).

        Returns:
            One gradient (or ``None``) per leaf of the original ``(args, kwargs)``:
            chunks are concatenated back, replicated leaves get the sum.
        """
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
                    p if p is not None else ref.new_zeros(_with_dim(ref.shape, rule.dim, s))
                    for p, s in zip(parts, rule.sizes)
                ]
                out.append(torch.cat(full, dim=rule.dim))
            elif rule.kind == "replicate":
                out.append(torch.stack([p for p in parts if p is not None]).sum(0))
            else:  # packed: one value per microbatch, kept apart
                out.append(RoundPipePackedData(parts))
        return out


def _with_dim(shape: torch.Size, dim: int, size: int) -> list[int]:
    s = list(shape)
    s[dim] = size
    return s


def _chunk_dim(spec: TensorChunkSpec, leaf: Any, where: str) -> int:
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
        psizes = [
            int(v.shape[0]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else None
            for v in packed[0]
        ]
        if all(s is not None for s in psizes):
            sizes = [int(s) for s in psizes]  # type: ignore[arg-type]
            bs = sum(sizes)
        else:
            sizes, bs = None, None
    else:
        dims = [
            int(x.shape[d])
            for x, m, w in zip(leaves, markers, places)
            if isinstance(m, TensorChunkSpec) and (d := _chunk_dim(m, x, w)) >= 0
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
        elif isinstance(m, TensorChunkSpec):
            dim = _chunk_dim(m, x, w)
            chunks = list(torch.tensor_split(x, n, dim=dim))
            rule = _LeafRule("chunk", dim, tuple(int(c.shape[dim]) for c in chunks))
        elif (
            m is None
            and sizes is not None
            and isinstance(x, torch.Tensor)
            and x.dim() >= 1
            and x.shape[0] == bs
        ):
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
    row_sizes = sizes if sizes is not None else []
    return per_mb, rules, row_sizes, (bs if sizes is not None else None)


def _check_spec_pair(split_input: Any) -> tuple[Any, Any]:
    if not (isinstance(split_input, (tuple, list)) and len(split_input) == 2):
        raise TypeError(
            "split_input must be None, a function f(args, kwargs, n) or a pair "
            f"(args_spec, kwargs_spec); got {split_input!r}"
        )
    return split_input[0], split_input[1]


def split_call_inputs(
    split_input: Any, args: tuple, kwargs: dict, num_microbatch: int
) -> SplitInputs:
    """Cut a call's ``(args, kwargs)`` into microbatches as ``split_input`` says.

    Args:
        split_input: ``None`` (automatic), ``(args_spec, kwargs_spec)``, or a function
            ``f(args, kwargs, n)`` returning ``(args_list, kwargs_list)`` or
            ``[(args, kwargs), ...]``.
        args: positional inputs.
        kwargs: keyword inputs.
        num_microbatch: the number of microbatches wanted (fewer when the batch is
            smaller; packed inputs decide it themselves).

    Returns:
        A :class:`SplitInputs`.

    Raises:
        TypeError / ValueError: on a malformed spec or function result, naming it.
    """
    if (
        not isinstance(num_microbatch, int)
        or isinstance(num_microbatch, bool)
        or num_microbatch < 1
    ):
        raise ValueError(f"num_microbatch must be a positive int, got {num_microbatch!r}")
    args, kwargs = tuple(args), dict(kwargs)
    if callable(split_input):
        parts = _normalise_split_result(split_input(args, kwargs, num_microbatch))
        return SplitInputs(_unpack_packed(parts), [], None, None)
    if split_input is None:
        args_spec, kwargs_spec = None, None
    else:
        args_spec, kwargs_spec = _check_spec_pair(split_input)
    markers = _leaf_specs(args_spec, args, "args") + _leaf_specs(kwargs_spec, kwargs, "kwargs")
    if any(isinstance(m, (_CustomReducer, bool)) for m, _ in markers):
        raise TypeError(
            "reducers are merge specs; split_input takes TensorChunkSpec, Replicate, None"
        )
    leaves, rebuild = flatten((args, kwargs))
    per_mb, rules, sizes, bs = _split_leaves(leaves, markers, num_microbatch, "split_input")
    parts = [rebuild(mb) for mb in per_mb]
    return SplitInputs([(tuple(a), dict(k)) for a, k in parts], sizes, bs, rules)


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
    out = []
    for i, (a, k) in enumerate(pairs):
        if not isinstance(a, (tuple, list)):
            raise TypeError(
                f"split_input: the args of microbatch {i} are a {type(a).__name__}, not a tuple"
            )
        if not isinstance(k, dict):
            raise TypeError(
                f"split_input: the kwargs of microbatch {i} are a {type(k).__name__}, not a dict"
            )
        out.append((tuple(a), dict(k)))
    return out


def _unpack_packed(parts: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """Microbatch ``i`` takes element ``i`` of any packed leaf a custom split passed on."""
    out = []
    for i, part in enumerate(parts):
        leaves, rebuild = flatten(part)
        if not any(isinstance(x, RoundPipePackedData) for x in leaves):
            out.append(part)
            continue
        new = []
        for x in leaves:
            if isinstance(x, RoundPipePackedData):
                if len(x) != len(parts):
                    raise ValueError(
                        f"packed input holds {len(x)} microbatches but split_input made "
                        f"{len(parts)}"
                    )
                x = x[i]
            new.append(x)
        a, k = rebuild(new)
        out.append((tuple(a), dict(k)))
    return out


def split_call_labels(
    split_label: Any,
    label: Any,
    num_parts: int,
    sizes: list[int] | None = None,
    batch_size: int | None = None,
) -> list[Any]:
    """Cut ``label`` into exactly ``num_parts`` microbatches (those of the inputs).

    Args:
        split_label: ``None`` (automatic), a spec mirroring the label, or a function
            ``f(label, n) -> [label, ...]``.
        label: the labels.
        num_parts: the number of input microbatches.
        sizes / batch_size: the inputs' row split (from :class:`SplitInputs`); automatic
            splitting uses it so label rows match input rows.

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
        labels = [_single(label)]
    elif split_label is None and sizes and len(sizes) == num_parts:
        leaves, rebuild = flatten(label)
        if any(isinstance(x, RoundPipePackedData) for x in leaves):
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


def _single(value: Any) -> Any:
    leaves, rebuild = flatten(value)
    if not any(isinstance(x, RoundPipePackedData) for x in leaves):
        return value
    return rebuild([x[0] if isinstance(x, RoundPipePackedData) else x for x in leaves])


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


# --------------------------------------------------------------------------- merging
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
        """Per-microbatch gradients of the output leaves from the merged output's.

        Args:
            grads: one gradient (or ``None``) per leaf of ``flatten(merged)``.

        Returns:
            For each microbatch, one gradient per output leaf: the matching slice of a
            concatenation, ``g / n`` for an average, ``g`` for a sum, ``g`` to
            microbatch 0 only for a replicated value.
        """
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
    """Merge the per-microbatch outputs as ``merge_output`` says (see the module doc)."""
    return merge_outputs_with_grad(merge_output, outputs).merged


def merge_outputs_with_grad(merge_output: Any, outputs: list[Any]) -> MergedOutputs:
    """:func:`merge_outputs` that also says how to send gradients back per microbatch."""
    if not outputs:
        raise ValueError("no microbatch outputs to merge")
    n = len(outputs)
    if merge_output is False:
        leaves, rebuild = flatten(outputs[0])
        flat = _same_structure(outputs)
        packed = [RoundPipePackedData([f[i] for f in flat]) for i in range(len(leaves))]
        return MergedOutputs(rebuild(packed), None, n)
    if callable(merge_output):
        return MergedOutputs(merge_output(list(outputs)), None, n)
    if merge_output is None or merge_output is True:
        spec_leaves = None
    else:
        spec_leaves = _leaf_specs(merge_output, outputs[0], "merge_output")
    if n == 1:
        leaves, _ = flatten(outputs[0])
        rules = [("first",) if isinstance(x, torch.Tensor) else ("none",) for x in leaves]
        return MergedOutputs(outputs[0], rules, 1)
    flat = _same_structure(outputs)
    rebuild = flatten(outputs[0])[1]
    merged, rules = [], []
    for i in range(len(flat[0])):
        vals = [f[i] for f in flat]
        m, w = spec_leaves[i] if spec_leaves is not None else (None, f"output leaf {i}")
        value, rule = _merge_leaf(vals, m, w)
        merged.append(value)
        rules.append(rule)
    return MergedOutputs(rebuild(merged), rules, n)


def _same_structure(outputs: list[Any]) -> list[list[Any]]:
    flat = [flatten(o)[0] for o in outputs]
    if any(len(f) != len(flat[0]) for f in flat):
        raise ValueError(
            "microbatch outputs have different structures; give a merge_output function"
        )
    return flat


def _merge_leaf(vals: list[Any], marker: Any, where: str) -> tuple[Any, tuple]:
    v0 = vals[0]
    n = len(vals)
    if marker is None:  # automatic
        if isinstance(v0, torch.Tensor):
            if v0.dim() == 0:
                return _mean(vals), ("mean", n)
            return torch.cat(vals, dim=0), ("cat", 0, tuple(int(v.shape[0]) for v in vals))
        return _replicated(vals, where), ("none",)
    if isinstance(marker, TensorChunkSpec):
        dim = _chunk_dim(marker, v0, where)
        return torch.cat(vals, dim=dim), ("cat", dim, tuple(int(v.shape[dim]) for v in vals))
    if _is_replicate(marker):
        value = _replicated(vals, where)
        return value, (("first",) if isinstance(v0, torch.Tensor) else ("none",))
    if isinstance(marker, _MeanReducer):
        return _mean(vals), ("mean", n)
    if isinstance(marker, _SumReducer):
        return torch.stack(vals).sum(0) if isinstance(v0, torch.Tensor) else sum(vals), ("sum",)
    if isinstance(marker, _CustomReducer):
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


# --------------------------------------------------------------------------- compat
def default_split_input(args: tuple, kwargs: dict, num_microbatch: int) -> list[tuple[tuple, dict]]:
    """Split positional and keyword inputs into at most ``num_microbatch`` microbatches."""
    return split_call_inputs(None, args, kwargs, num_microbatch).parts


def default_split_label(label: Any, num_microbatch: int) -> list[Any]:
    """Split labels the same way as inputs (by their own leading size)."""
    bs = batch_size_of(label)
    return split_tree(label, split_sizes(bs, num_microbatch), bs)


def sum_merge_output(outputs: list[Any]) -> Any:
    """Concatenate batch-leading tensors along dim 0, **sum** 0-dim tensors and keep the
    first microbatch's value for non-tensors: for per-microbatch sums (a loss summed
    over tokens, a token count) whose total is wanted rather than their average."""
    if len(outputs) == 1:
        return outputs[0]
    flat = _same_structure(outputs)
    merged = []
    for i in range(len(flat[0])):
        vals = [f[i] for f in flat]
        v0 = vals[0]
        if isinstance(v0, torch.Tensor):
            merged.append(torch.stack(vals).sum(0) if v0.dim() == 0 else torch.cat(vals, dim=0))
        else:
            merged.append(v0)
    return flatten(outputs[0])[1](merged)


#: What the engine merges with until it calls :func:`merge_outputs` (whose automatic rule
#: averages 0-dim tensors, as the published RoundPipe); its autograd backward sends the
#: same gradient to every microbatch, which is the adjoint of this sum.
default_merge_output = sum_merge_output
