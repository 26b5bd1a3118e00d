"""Hugging Face presets: convert a causal LM into an equivalent ``nn.Sequential``.

``wrap_model_to_roundpipe(model)`` looks the model's class up in a registry of
*presets* (converters), converts it and wraps the result in a ``RoundPipe``
whose attribute access falls through to the original model
(``rp.config``, ``rp.vocab_size`` keep working). Users add presets for their
own classes with :func:`register_preset`.

Built-in presets: ``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM``, ``GPT2LMHeadModel``,
``Qwen3MoeForCausalLM``. Classes are matched by name along the MRO, so
``transformers`` is imported only when a model is converted.

Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .common import (
    IGNORE_INDEX,
    CausalLMInputAdapter,
    CausalLMLossFn,
    CausalLMOutput,
    CausalLMOutputAdapter,
    DecoderBlock,
    causal_lm_loss,
    causal_lm_loss_fn,
    count_label_tokens,
    shift_labels,
)

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
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "model", None), nn.Module):
            model = model.model
        else:
            return model
    return model


def convert_to_sequential(model: nn.Module) -> nn.Sequential:
    """Convert ``model`` (possibly peft-wrapped) with its preset.

    Raises:
        ValueError: if no preset matches; the message lists the known ones.
    """
    base = unwrap_peft(model)
    converter = find_preset(base)
    if converter is None:
        raise ValueError(
            f"no RoundPipe preset for {type(base).__name__}; known presets: "
            f"{', '.join(known_presets())}. Register one with "
            "roundpipe_core.presets.register_preset(cls, converter), convert the model to an "
            "nn.Sequential yourself, or pass use_sequential_preset=False for the experimental "
            "automatic split"
        )
    seq = converter(base)
    if not isinstance(seq, nn.Sequential):
        raise TypeError(
            f"the preset for {type(base).__name__} returned {type(seq).__name__}, not nn.Sequential"
        )
    return seq


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: bool = True,
    model_run_config: Any = None,
    optim_dtype: torch.dtype | None = None,
    split_threshold: int | None = None,
    **roundpipe_kwargs: Any,
) -> Any:
    """Wrap a model for RoundPipe in one call.

    Args:
        model: a Hugging Face causal LM with a preset (possibly wrapped by
            ``peft``), an ``nn.Sequential``, or -- with
            ``use_sequential_preset=False`` -- any module.
        use_sequential_preset: ``True``: convert with the preset of the
            model's class (``ValueError`` listing the known presets if there is
            none). ``False``: skip presets and use the experimental automatic
            split (:mod:`roundpipe_core.autosplit`).
        model_run_config: default ``RoundPipeRunConfig`` of the model.
        optim_dtype: dtype of the optimizer's master weights (``None`` = as the model).
        split_threshold: automatic split only: modules with more parameters
            (elements) than this are split further (default: 1/8 of the model).
        **roundpipe_kwargs: more ``RoundPipe(...)`` arguments (``pin_model``,
            ``devices``, ``name``).

    Returns:
        A ``RoundPipe`` (attribute access falls through to ``model``), or an
        ``AutoRoundPipe`` when the automatic split cannot make a Sequential.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model_to_roundpipe needs an nn.Module, got {type(model).__name__}")
    if not use_sequential_preset:
        from ..autosplit import auto_wrap

        return auto_wrap(
            model,
            split_threshold=split_threshold,
            model_run_config=model_run_config,
            optim_dtype=optim_dtype,
            **roundpipe_kwargs,
        )
    from ..model import RoundPipe

    if isinstance(model, nn.Sequential):
        return RoundPipe(
            model, optim_dtype=optim_dtype, model_run_config=model_run_config, **roundpipe_kwargs
        )
    seq = convert_to_sequential(model)
    roundpipe_kwargs.setdefault("name", type(unwrap_peft(model)).__name__)
    return RoundPipe(
        seq,
        optim_dtype=optim_dtype,
        model_run_config=model_run_config,
        original_model=model,
        **roundpipe_kwargs,
    )


def _register_builtin() -> None:
    from .gpt2 import convert_gpt2
    from .llama import convert_llama
    from .mistral import convert_mistral
    from .qwen2 import convert_qwen2
    from .qwen3 import convert_qwen3
    from .qwen3_moe import convert_qwen3_moe

    register_preset("LlamaForCausalLM", convert_llama)
    register_preset("Qwen3ForCausalLM", convert_qwen3)
    register_preset("Qwen2ForCausalLM", convert_qwen2)
    register_preset("MistralForCausalLM", convert_mistral)
    register_preset("GPT2LMHeadModel", convert_gpt2)
    register_preset("Qwen3MoeForCausalLM", convert_qwen3_moe)


_register_builtin()

__all__ = [
    "IGNORE_INDEX",
    "CausalLMInputAdapter",
    "CausalLMLossFn",
    "CausalLMOutput",
    "CausalLMOutputAdapter",
    "DecoderBlock",
    "causal_lm_loss",
    "causal_lm_loss_fn",
    "convert_to_sequential",
    "count_label_tokens",
    "find_preset",
    "known_presets",
    "register_preset",
    "shift_labels",
    "unwrap_peft",
    "wrap_model_to_roundpipe",
]
