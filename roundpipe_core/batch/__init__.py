"""Split inputs and labels into microbatches and merge outputs back (any pytree).

How a call is cut (``RoundPipeRunConfig``): **automatic** (``None``: tensors whose dim 0
is the batch size split into near-equal parts, larger first; every other leaf
replicated), **specs** mirroring the value (``TensorChunkSpec(dim)``, ``Replicate``,
``None`` for automatic; torch.distributed.pipelining's markers work the same), or **a
function** (``split_input(args, kwargs, n)`` returning ``(args_list, kwargs_list)`` or
``[(args, kwargs), ...]``; ``split_label(label, n)``).

Merging (``merge_output``): ``None``/``True`` concatenates tensors along dim 0,
**averages** 0-dim tensors and keeps non-tensors equal in every microbatch; a spec uses
``TensorChunkSpec(dim)``, ``Replicate`` or a reducer (``avg_reducer``, ``sum_reducer``,
any ``Reducer``); a function gets the list of outputs; ``False`` returns every leaf as
a :class:`RoundPipePackedData`, which a following call takes as already split.

Containers: tuples, lists, dicts, namedtuples, ``torch.utils._pytree`` nodes (Hugging
Face ``ModelOutput``) and dataclasses. Pieces: :mod:`.tree` (pytrees, packed data,
markers), :mod:`.split` and :mod:`.merge`.
"""

from .explain import AutoSplitLeaf, auto_split_note
from .merge import (
    MergedOutputs,
    merge_outputs,
    merge_outputs_with_grad,
    sum_merge_output,
)
from .split import SplitInputs, default_split_input, split_call_inputs, split_call_labels
from .tree import (
    Reducer,
    Replicate,
    RoundPipePackedData,
    TensorChunkSpec,
    avg_reducer,
    batch_size_of,
    check_run_specs,
    flatten,
    split_sizes,
    split_tree,
    sum_reducer,
)

__all__ = [
    "RoundPipePackedData",
    "TensorChunkSpec",
    "Replicate",
    "Reducer",
    "avg_reducer",
    "sum_reducer",
    "SplitInputs",
    "AutoSplitLeaf",
    "auto_split_note",
    "MergedOutputs",
    "flatten",
    "batch_size_of",
    "split_sizes",
    "split_tree",
    "check_run_specs",
    "split_call_inputs",
    "split_call_labels",
    "merge_outputs",
    "merge_outputs_with_grad",
    "default_split_input",
    "sum_merge_output",
]
