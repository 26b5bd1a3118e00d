"""What keeps a unit call of the automatic split (:class:`~roundpipe_core.autosplit.AutoRoundPipe`)
from being silently wrong.

A unit's call is cut into microbatches along dim 0 of its inputs, and its outputs are
merged back (concatenated; 0-dim tensors averaged). Both are only right when dim 0 is
the batch and when no output is a reduction over the whole call; and a unit runs on a
device replica, so state its code hands to later units beside its inputs and outputs, or
keeps on its modules, does not come back. The checks here make a call run as one
microbatch, give Hugging Face's loss the whole batch's token count, find the host code's
own uses of a unit's parameters, or refuse naming the unit and the option that fixes it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .autosplit_rules import has_own_forward
from .batch.explain import leaf_paths
from .batch.tree import Replicate, flatten

__all__ = [
    "WHOLE_CALL",
    "HostReads",
    "caller_of",
    "check_no_batch_reduction",
    "check_no_state_written",
    "mutable_state",
    "not_batch_leading",
    "spelled",
    "token_count_kwargs",
]

#: Hugging Face loss types whose loss is a mean over label tokens != -100, and whether the
#: labels are shifted by one first (transformers.loss.loss_utils.LOSS_MAPPING)
_TOKEN_MEAN_LOSSES = {"ForCausalLM": True, "ForConditionalGeneration": True, "ForMaskedLM": False}
_IGNORE_INDEX = -100


def not_batch_leading(args: tuple, kwargs: dict, batch: int | None) -> str | None:
    """The first input tensor whose dim 0 is neither the call's batch nor 1 (a broadcast
    dim), described; ``None`` if every tensor is batch-leading."""
    for where, value in (("args", args), ("kwargs", kwargs)):
        for path, leaf in zip(leaf_paths(value, where), flatten(value)[0]):
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
                if leaf.shape[0] not in (batch, 1):
                    return f"input {path} of shape {tuple(leaf.shape)}"
    return None


#: ``split_input`` of a call that must not be cut: every input whole, in one microbatch
#: (also where the engine would otherwise sample two rows to measure activations)
WHOLE_CALL = (Replicate, Replicate)


def _takes_loss_kwargs(unit: nn.Module) -> bool:
    params = inspect.signature(type(unit).forward).parameters.values()
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "num_items_in_batch" for p in params
    )


def _token_mean_loss(unit: nn.Module) -> bool | None:
    """Whether ``unit``'s Hugging Face loss shifts its labels (a causal LM), ``False`` for a
    masked LM, ``None`` for anything else (not a Hugging Face model, another loss, a
    ``loss_function`` of the user's). As ``PreTrainedModel.loss_function``: a model without
    a ``loss_type`` (GPT-2's class name names none) computes the causal LM loss."""
    if not hasattr(type(unit), "loss_function") or "_loss_function" in vars(unit):
        return None
    loss_type = getattr(unit, "loss_type", None) or "ForCausalLM"
    return _TOKEN_MEAN_LOSSES.get(loss_type)


def token_count_kwargs(unit: nn.Module, kwargs: dict, num_microbatch: int) -> dict | None:
    """``kwargs`` with ``num_items_in_batch`` set so that the microbatches' Hugging Face
    losses average to the whole batch's loss, or ``None`` if ``unit`` computes no such loss.

    A token-mean loss (Hugging Face's causal / masked LM loss) with ``num_items_in_batch=N``
    is the microbatch's sum over tokens divided by ``N``. ``N`` is the whole call's count of
    label tokens != -100 (after the shift, for a causal LM), or the caller's own
    ``num_items_in_batch``; each microbatch gets ``N / num_microbatch``, because the merge
    averages the microbatches' 0-dim outputs: the average is then (sum of all tokens' losses)
    / ``N``, Hugging Face's loss, and so are its gradients.
    """
    labels = kwargs.get("labels")
    shifted = _token_mean_loss(unit)
    if not isinstance(labels, torch.Tensor) or shifted is None or not _takes_loss_kwargs(unit):
        return None
    count = kwargs.get("num_items_in_batch")
    if count is None:
        counted = kwargs.get("shift_labels")
        if not isinstance(counted, torch.Tensor):
            counted = labels[..., 1:] if shifted else labels
        count = (counted != _IGNORE_INDEX).sum()
    return {**kwargs, "num_items_in_batch": count / num_microbatch}


def mutable_state(args: tuple, kwargs: dict) -> list[tuple[str, Any, tuple]]:
    """``(where, object, contents)`` of the input leaves a unit could write state into for
    later units: mutable containers the batch split does not open (a ``UserDict`` such as
    transformers' ``KVSharingDict``, any ``MutableMapping`` or ``MutableSequence``); contents
    by identity, so that a write during the call shows."""
    out = []
    for where, value in (("args", args), ("kwargs", kwargs)):
        for path, leaf in zip(leaf_paths(value, where), flatten(value)[0]):
            if isinstance(leaf, (MutableMapping, MutableSequence)):
                out.append((path, leaf, _contents(leaf)))
    return out


def _contents(obj: Any) -> tuple:
    if isinstance(obj, MutableMapping):
        return tuple((k, id(v)) for k, v in obj.items())
    return tuple(id(v) for v in obj)


def check_no_state_written(
    state: list[tuple[str, Any, tuple]], unit_name: str, unit: nn.Module, model: nn.Module
) -> None:
    """Refuse a unit call that wrote into a mutable input (state handed to later units beside
    the call's outputs): the unit ran on a device replica, once per microbatch, so what it
    stored is the last microbatch's, on the device, and outside the autograd graph of the
    call -- a later unit reading it would get other rows and send no gradient back."""
    for where, obj, before in state:
        if _contents(obj) != before:
            parent = caller_of(model, unit_name)
            raise ValueError(
                f"automatic split: unit {unit_name or '<root>'!r} ({type(unit).__name__}) wrote "
                f"into its input {where}, a {type(obj).__name__}: state passed on to later units "
                "outside the call's inputs and outputs (as Gemma 3n's shared key/value states). "
                "Across separate units it would hold one microbatch's values and lose its "
                "gradient. Make the module that passes it on one unit: "
                f"override_config={{{spelled(parent)}: RoundPipeRunConfig()}} (or a module above "
                "it) in wrap_model_to_roundpipe / auto_wrap"
            )


def caller_of(model: nn.Module, name: str) -> str:
    """The nearest module above ``name`` with a forward of its own (a ModuleList's parent):
    the one whose code calls it, which ``override_config`` can make one unit."""
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        if has_own_forward(model.get_submodule(name)):
            return name
    return name


def spelled(name: str) -> str:
    """How a user names the submodule ``name`` of ``model`` in Python."""
    if not name:
        return "model"
    if all(part.isidentifier() for part in name.split(".")):
        return f"model.{name}"
    return f"model.get_submodule({name!r})"


def check_no_batch_reduction(
    out: Any, loss_normalised: bool, unit_name: str, unit: nn.Module, num_microbatch: int
) -> None:
    """Refuse a 0-dim floating output of a call cut into microbatches (other than the loss
    :func:`token_count_kwargs` normalised, the first output leaf): the merge averages the
    microbatches' values, which is not the whole batch's value for a mean over tokens, a
    sum, a load-balancing loss ..."""
    for i, leaf in enumerate(flatten(out)[0]):
        if not (isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and leaf.is_floating_point()):
            continue
        if loss_normalised and i == 0:
            continue
        raise ValueError(
            f"automatic split: unit {unit_name or '<root>'!r} ({type(unit).__name__}) returned "
            f"a 0-dim tensor (output leaf {i}) computed on each of its {num_microbatch} "
            "microbatches; their average is not the whole batch's value (a mean over tokens, a "
            "sum, an auxiliary loss differ). Run that module as one microbatch: "
            f"override_config={{{spelled(unit_name)}: RoundPipeRunConfig(num_microbatch=1)}} "
            "in wrap_model_to_roundpipe / auto_wrap"
        )


class HostReads(TorchFunctionMode):
    """Watches the host code of one ``AutoRoundPipe.forward`` (this thread only: torch
    function modes are thread-local, the units run on worker threads) for parameters of a
    unit used outside that unit's call -- ``F.conv1d(x, self.conv1d.weight)`` in a parent's
    forward. Such a use computes with the model's own tensor, so its gradient lands in that
    tensor's ``.grad``, not in the master the unit's gradients go to: the parameters found
    are then collected from the host too (``AutoRoundPipe.host_parameters``)."""

    def __init__(self, unit_params: Mapping[int, nn.Parameter]) -> None:
        super().__init__()
        self.unit_params = unit_params
        self.found: dict[int, nn.Parameter] = {}
        self.paused = 0  # > 0 inside a unit's own call

    def _note(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) in self.unit_params:
                self.found[id(value)] = self.unit_params[id(value)]
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._note(v)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # only a use a gradient flows back through (not .dtype, .shape, .detach() ...)
        if not self.paused and isinstance(out, torch.Tensor) and out.requires_grad:
            self._note(args)
            self._note(tuple(kwargs.values()))
        return out
