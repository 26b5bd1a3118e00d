"""Split inputs and labels into microbatches and merge outputs back, for any pytree
(tuples, lists, dicts, namedtuples, ``torch.utils._pytree`` nodes such as Hugging Face's
``ModelOutput``, dataclasses). The rules (automatic, specs, functions, reducers such as
``avg_reducer`` / ``sum_reducer``, ``merge_output=False``) are docs/user-guide.md's
"Run configuration". Pieces: :mod:`.tree` (pytrees, packed data, markers), :mod:`.split`
and :mod:`.merge`.
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
