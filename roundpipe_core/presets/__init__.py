"""Hugging Face causal LMs: convert one into an equivalent ``nn.Sequential`` and wrap it.

``wrap_model_to_roundpipe(model)`` converts the model with the *preset* registered for
its class (:func:`register_preset`; classes matched by name along the MRO, so
``transformers`` is imported only when a model is converted), else by its structure
(:func:`.generic.convert_decoder_lm`), else uses the experimental automatic split, with a
log line saying why. A converted model is called like the original and returns a Hugging
Face ``ModelOutput`` (:mod:`.head`). See docs/presets.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from ..autosplit import auto_wrap, check_split_arguments, nbytes
from ..config import check_run_config
from ..loss import batch_normalized
from ..model import RoundPipe
from ..running.devices.pool import DevicePool, resolve_devices
from .common import CausalLMInputAdapter, GenericDecoderBlock
from .generic import convert_decoder_lm
from .loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    CausalLMLossFn,
    causal_lm_loss,
    causal_lm_loss_fn,
    chunked_linear_cross_entropy,
    count_label_tokens,
    shift_labels,
)
from .probe import LayerRecipe, check_conversion
from .structure import find_decoder_parts

_log = logging.getLogger(__name__)

# Upstream's default: modules holding at least this many bytes themselves are wrapped whole.
DEFAULT_LOWER_THRESHOLD = 16 * 1024

Converter = Callable[[nn.Module], nn.Sequential]

_REGISTRY: dict[type | str, Converter] = {}


def register_preset(hf_class_or_name: type | str, converter: Converter) -> None:
    """Register ``converter`` for a model class (or a class name).

    Args:
        hf_class_or_name: the model class, or its ``__name__`` (matching by
            name avoids importing the class). Subclasses match too.
        converter: ``converter(model) -> nn.Sequential``. The Sequential must
            reuse the model's own modules (so parameters are shared and
            training updates the model in place), pass tensors between layers
            with the batch as dim 0, and follow the forward rules (no writes
            to plain attributes or shared buffers in forward).

    Raises:
        TypeError: if the arguments have the wrong types.
    """
    if not isinstance(hf_class_or_name, (type, str)):
        raise TypeError(
            f"register_preset needs a class or a class name, got {type(hf_class_or_name).__name__}"
        )
    if not callable(converter):
        raise TypeError(f"register_preset needs a callable converter, got {converter!r}")
    _REGISTRY[hf_class_or_name] = converter


def known_presets() -> list[str]:
    """Names of the classes that have a preset."""
    return sorted(k if isinstance(k, str) else k.__name__ for k in _REGISTRY)


def find_preset(model: nn.Module) -> Converter | None:
    """The converter for ``model``'s class (first match along its MRO), or ``None``."""
    for cls in type(model).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
        if cls.__name__ in _REGISTRY:
            return _REGISTRY[cls.__name__]
    return None


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``peft`` wrapper (LoRA layers stay injected in it).

    ``PeftModel`` -> ``get_base_model()``; a bare tuner (``LoraModel``) -> ``.model``.
    Anything else is returned unchanged.
    """
    for _ in range(4):  # PeftModel -> LoraModel -> base model, at most a few levels
        module = type(model).__module__ or ""
        if not module.startswith("peft"):
            return model
        get_base = getattr(model, "get_base_model", None)
        if callable(get_base):
            model = get_base()
        elif isinstance(inner := getattr(model, "model", None), nn.Module):
            model = inner
        else:
            return model
    return model


class NoPresetError(ValueError, NotImplementedError):
    """No preset converts this model's class.

    A ``ValueError`` (a value the call cannot take) and, as in the published
    RoundPipe, a ``NotImplementedError``, so code written for either catches it.
    """


def convert_to_sequential(model: nn.Module) -> nn.Sequential:
    """Convert ``model`` (possibly peft-wrapped) with its preset, else by its structure.

    Raises:
        NoPresetError: if no preset matches and the converter by structure
            (:func:`.generic.convert_decoder_lm`) refuses the model; the message
            says why and lists the known presets.
    """
    seq = _convert(model, strict=True)
    assert seq is not None
    return seq


def convert_if_possible(model: nn.Module) -> nn.Sequential | None:
    """``model`` (possibly peft-wrapped) converted by its preset or by its structure, or ``None``.

    ``None`` when no preset matches and the converter by structure refuses the
    model; the reason is logged (INFO, logger ``roundpipe_core.presets``; WARNING
    if the converter failed with anything but its ``ValueError``) and the caller
    uses the automatic split. A preset's own errors propagate.
    """
    return _convert(model, strict=False)


def _convert(model: nn.Module, strict: bool) -> nn.Sequential | None:
    base = unwrap_peft(model)
    name = type(base).__name__
    converter = find_preset(base)
    if converter is not None:
        seq = converter(base)
        if not isinstance(seq, nn.Sequential):
            raise TypeError(
                f"the preset for {name} returned {type(seq).__name__}, not nn.Sequential"
            )
        how = "its preset"
    else:
        try:
            seq = convert_decoder_lm(base)
        except ValueError as exc:
            if strict:
                why = str(exc).removeprefix(f"{name} cannot be converted by structure: ")
                raise NoPresetError(
                    f"no RoundPipe preset for {name}, and it cannot be converted by structure: "
                    f"{why}. Known presets: {', '.join(known_presets())}. Register one with "
                    "roundpipe_core.presets.register_preset(cls, converter), convert the model "
                    "to an nn.Sequential yourself, or pass use_sequential_preset=None/False for "
                    "the experimental automatic split"
                ) from exc
            _log.info(
                "%s gets the automatic split (no fused forward_backward, not pipelined layer by "
                "layer): %s",
                name,
                exc,
            )
            return None
        except Exception as exc:
            if strict:
                raise
            # a converter bug must not stop a model the split can run
            _log.warning(
                "%s gets the automatic split: the converter by structure failed with %s: %s "
                "(please report it)",
                name,
                type(exc).__name__,
                exc,
            )
            return None
        how = "its structure"
    _log.info(
        "%s converted by %s; pass use_sequential_preset=False for the automatic split instead",
        name,
        how,
    )
    return seq


@batch_normalized
def model_output_loss(outputs: Any, labels: Any = None) -> torch.Tensor:
    """``loss_fn`` for ``forward_backward`` when the model computes its own loss (``labels=`` input).

    Marked :func:`~roundpipe_core.loss.batch_normalized`: with ``num_items_in_batch``
    counting the whole batch's tokens, each microbatch's ``.loss`` is already its share of
    Hugging Face's loss, so ``loss_reduction="sum"`` and ``"mean"`` both add them up to it.

    Example::

        n = count_label_tokens(labels)   # whole batch: microbatch losses sum to HF's loss
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "labels": labels, "num_items_in_batch": n,
                          "return_logits": False},
            loss_fn=model_output_loss)
    """
    loss = getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"model_output_loss needs an output with a .loss tensor, got {type(outputs).__name__} "
            "without one; call the model with labels="
        )
    return loss


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: bool | None = None,
    lower_threshold: int = DEFAULT_LOWER_THRESHOLD,
    upper_threshold: int | None = None,
    skip_modules: Collection[nn.Module] = (),
    override_config: Mapping[nn.Module, Any] | None = None,
    model_run_config: Any = None,
    name: str | None = None,
    optim_dtype: torch.dtype | None = None,
    split_threshold: int | None = None,
    **roundpipe_kwargs: Any,
) -> Any:
    """Wrap a model for RoundPipe in one call, with a preset or the automatic split.

    Args:
        model: a Hugging Face causal LM (possibly wrapped by ``peft``), an
            ``nn.Sequential``, or any module.
        use_sequential_preset: ``None`` (default): convert with the preset of
            the model's class if there is one, else by its structure
            (:func:`.generic.convert_decoder_lm`), else (logging why) use the
            automatic split. ``True``: a preset or the structure, else
            :class:`NoPresetError` (saying why, listing the known presets).
            ``False``: the automatic split
            (:mod:`roundpipe_core.autosplit`), even if a preset exists.
        lower_threshold, upper_threshold, split_threshold, skip_modules, override_config:
            the automatic split's options, as :func:`~roundpipe_core.autosplit.auto_wrap`'s
            (ignored when the model is converted); here ``lower_threshold`` defaults to
            16 KiB and ``upper_threshold`` to the model's bytes / (devices + 1).
        model_run_config: default ``RoundPipeRunConfig`` of the model.
        name: a name for logs (default: the model's class name).
        optim_dtype: dtype of the optimizer's master weights (``None`` = as the model).
        **roundpipe_kwargs: more ``RoundPipe(...)`` arguments (``pin_model``, ``devices``).

    Returns:
        A ``RoundPipe`` (attribute access falls through to ``model``), or an
        ``AutoRoundPipe`` when the automatic split cannot make a Sequential.

    Raises:
        TypeError / ValueError: for arguments of the wrong type or value.
        NoPresetError: ``use_sequential_preset=True``, no preset matches and the converter
            by structure refuses the model (the message says why).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model_to_roundpipe needs an nn.Module, got {type(model).__name__}")
    if use_sequential_preset is not None and not isinstance(use_sequential_preset, bool):
        raise TypeError(
            "use_sequential_preset must be None (try a preset, else split automatically), True "
            f"(a preset or an error) or False (automatic split), got {use_sequential_preset!r}"
        )
    # checked here too where a preset converts the model (the split's options unused)
    check_split_arguments(
        split_threshold, upper_threshold, lower_threshold, skip_modules, override_config
    )
    if model_run_config is not None:
        check_run_config(model_run_config, "model_run_config")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")
    if name is not None:
        roundpipe_kwargs["name"] = name
    if use_sequential_preset is not False:
        seq: nn.Module | None = model
        if not isinstance(model, nn.Sequential):
            seq = _convert(model, strict=bool(use_sequential_preset))
        if seq is not None:
            if seq is not model:
                roundpipe_kwargs.setdefault("name", type(unwrap_peft(model)).__name__)
                roundpipe_kwargs["original_model"] = model
            return RoundPipe(
                seq,
                optim_dtype=optim_dtype,
                model_run_config=model_run_config,
                **roundpipe_kwargs,
            )
    if split_threshold is None and upper_threshold is None:
        # as the published RoundPipe: the model's bytes over one unit more than there are devices
        devices = roundpipe_kwargs.get("devices")
        count = len(devices) if isinstance(devices, DevicePool) else len(resolve_devices(devices))
        upper_threshold = max(1, nbytes(model) // (count + 1))
    return auto_wrap(
        model,
        split_threshold=split_threshold,
        model_run_config=model_run_config,
        optim_dtype=optim_dtype,
        upper_threshold=upper_threshold,
        lower_threshold=lower_threshold,
        skip_modules=skip_modules,
        override_config=override_config,
        **roundpipe_kwargs,
    )


def __getattr__(name: str) -> Any:
    # The output classes need transformers (optional): load them on first use.
    if name in ("RoundPipeCausalLMOutput", "RoundPipeMoeCausalLMOutput", "CausalLMOutputAdapter"):
        from . import head

        return getattr(head, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The built-in presets: the converter by structure, registered so that a refusal is raised
# (a bug to report) rather than met with the automatic split.
for _name in (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "GPT2LMHeadModel",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
):
    register_preset(_name, convert_decoder_lm)

__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "DEFAULT_LOWER_THRESHOLD",
    "IGNORE_INDEX",
    "CausalLMInputAdapter",
    "CausalLMLossFn",
    "CausalLMOutputAdapter",
    "GenericDecoderBlock",
    "LayerRecipe",
    "NoPresetError",
    "RoundPipeCausalLMOutput",
    "RoundPipeMoeCausalLMOutput",
    "causal_lm_loss",
    "causal_lm_loss_fn",
    "check_conversion",
    "chunked_linear_cross_entropy",
    "convert_decoder_lm",
    "convert_if_possible",
    "convert_to_sequential",
    "count_label_tokens",
    "find_decoder_parts",
    "find_preset",
    "known_presets",
    "model_output_loss",
    "register_preset",
    "shift_labels",
    "unwrap_peft",
    "wrap_model_to_roundpipe",
]
