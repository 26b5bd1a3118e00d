"""A bitsandbytes 4-bit model on the meta device: budget a QLoRA run of a model too large
to build (Llama-3.1-70B) without its weights.

bitsandbytes cannot quantize a meta tensor (its kernels read the values), but what a
quantized ``Linear4bit`` holds does not depend on them: :func:`quantize_on_meta` gives
it the ``Params4bit`` and ``QuantState`` (``_quant_state``) of the shapes and dtypes
real quantization gives (bitsandbytes 0.45 to 0.50, checked against it by
``tests/presets/test_qlora_meta.py``).
:func:`~roundpipe_core.running.host_memory.estimate_host_memory` counts a meta tensor's
bytes as if it were allocated, so the budget of the meta model is the budget of the
loaded one (peft adds its adapters to the meta model as to a loaded one).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from ..kinds import check_int

__all__ = ["quantize_on_meta"]

_NESTED_BLOCK = 256  # bitsandbytes' block size for the absmax of the absmax


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _quant_state(lin: nn.Linear, quant_type: str, double_quant: bool, blocksize: int) -> Any:
    from bitsandbytes.functional import QuantState

    shape, dtype = lin.weight.shape, lin.weight.dtype  # (out_features, in_features)
    blocks = -(-shape.numel() // blocksize)
    common = {"shape": shape, "blocksize": blocksize, "quant_type": quant_type, "dtype": dtype}
    code = _meta((16,), torch.float32)
    if not double_quant:
        return QuantState(absmax=_meta((blocks,), torch.float32), code=code, **common)
    nested = QuantState(
        absmax=_meta((-(-blocks // _NESTED_BLOCK),), torch.float32),
        code=_meta((256,), torch.float32),
        blocksize=_NESTED_BLOCK,
        dtype=torch.float32,
    )
    offset = _meta((), torch.float32)
    absmax = _meta((blocks,), torch.uint8)
    return QuantState(absmax=absmax, code=code, offset=offset, state2=nested, **common)


def quantize_on_meta(
    model: nn.Module,
    *,
    quant_type: str = "nf4",
    double_quant: bool = True,
    compute_dtype: torch.dtype = torch.bfloat16,
    blocksize: int = 64,
    skip: Collection[str] = ("lm_head",),
) -> nn.Module:
    """Replace every meta ``nn.Linear`` of ``model`` (in place; returned) by a bitsandbytes
    4-bit ``Linear4bit`` holding what loading with ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
    bnb_4bit_compute_dtype=compute_dtype)`` would (see the module docstring).

    Args:
        model: built on the meta device (``with torch.device("meta"): ...``).
        skip: last parts of module names (``"lm_head"``) of linears kept as they are
            (transformers keeps the output head unquantized).

    Raises:
        ValueError: a linear not on the meta device, an unknown ``quant_type``, a
            ``blocksize`` below 1. ImportError: bitsandbytes is not installed.
    """
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    check_int(blocksize, "blocksize")
    import bitsandbytes as bnb

    targets = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and name.rsplit(".", 1)[-1] not in set(skip)
    ]
    for name, lin in targets:
        if not lin.weight.is_meta:
            raise ValueError(
                f"quantize_on_meta: {name!r} is on {lin.weight.device}, not the meta device: "
                "build the model under `with torch.device('meta'):` (a real model is "
                "quantized by loading it with a BitsAndBytesConfig)"
            )
        q = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=double_quant,
            quant_type=quant_type,
            device="meta",
        )
        n = lin.in_features * lin.out_features
        q.weight = bnb.nn.Params4bit(
            _meta((-(-n // 2), 1), torch.uint8),
            requires_grad=False,
            quant_state=_quant_state(lin, quant_type, double_quant, blocksize),
            blocksize=blocksize,
            compress_statistics=double_quant,
            quant_type=quant_type,
            module=q,
            bnb_quantized=True,
        )
        if lin.bias is not None:
            q.bias = lin.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
    return model
