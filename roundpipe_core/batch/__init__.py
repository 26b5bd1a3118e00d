"""Split inputs and labels into microbatches and merge outputs back (any pytree).

Three ways to say how a call is cut into microbatches (``RoundPipeRunConfig``):

* **automatic** (``None``): tensors whose first dimension is the batch size are
  split along dim 0 into near-equal parts (sizes differ by at most one, larger
  first, as ``torch.tensor_split``); every other leaf (non-tensors, 0-dim
  tensors, tensors of another leading size) is replicated to every microbatch.
* **specs**: a structure that mirrors the value, whose leaves are
  ``TensorChunkSpec(dim)`` (split along ``dim``), ``Replicate`` (class or
  instance: the whole subtree goes to every microbatch) or ``None``
  (automatic for that subtree). ``split_input`` takes ``(args_spec,
  kwargs_spec)``; a dict spec may name only some keys. The markers of
  ``torch.distributed.pipelining.microbatch`` (``TensorChunkSpec``, ``_Replicate``,
  ``_CustomReducer``), which the published RoundPipe documents, work the same.
* **a function**: ``split_input(args, kwargs, n)`` returning either
  ``(args_list, kwargs_list)`` (the published RoundPipe's contract) or
  ``[(args, kwargs), ...]``; ``split_label(label, n) -> [label, ...]``.

Merging (``merge_output``): ``None``/``True`` concatenates tensors along dim 0,
**averages** 0-dim tensors over the microbatches and keeps non-tensors that
are equal in every microbatch; a spec structure uses ``TensorChunkSpec(dim)``
(concatenate along ``dim``), ``Replicate`` (equal in every microbatch) or a
reducer (``avg_reducer``, ``sum_reducer``, any ``Reducer``); a function
gets the list of outputs; ``False`` returns every leaf as a
:class:`RoundPipePackedData` of its per-microbatch values, which a following
RoundPipe call takes as already split.

Containers may be tuples, lists, dicts, namedtuples, anything registered with
``torch.utils._pytree`` (Hugging Face ``ModelOutput`` is) and dataclasses.

The pieces: :mod:`.tree` (pytrees, packed data, spec markers), :mod:`.split`
(``split_call_inputs`` / ``split_call_labels``) and :mod:`.merge` (``merge_outputs``).
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
