"""``RoundPipeRunConfig``: how one pipelined call runs, and its validation (once, when a
config meets the engine, so a bad value fails before any compute starts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from .batch import check_run_specs
from .kinds import RecomputeGrain, check_flag, check_int, parse_kind
from .planning.plan import ModelExecutePlan

__all__ = ["RoundPipeRunConfig", "check_run_config", "output_device"]


@dataclass
class RoundPipeRunConfig:
    """How a pipelined call runs. ``None`` fields fall back to the model's config,
    then to the defaults noted here.

    Attributes:
        requires_grad: build an autograd graph in ``forward()`` (default: grad mode is
            on and the model has trainable parameters).
        output_device: where outputs are returned (default CPU).
        preserve_rng_state: replay the forward's RNG in recompute (default True).
        recompute_grain: "stage" (recompute a whole stage, then backward) or "layer"
            (recompute and backpropagate one layer at a time; less memory). Default "stage".
        num_microbatch: microbatches per call (default: the pool's, from
            :func:`~roundpipe_core.planning.plan.default_num_microbatch`: devices + 1 on
            GPUs; on CPU workers 1, or one per worker where the one-stage plan runs on
            every worker at once -- the default for a model without buffers).
        split_input: ``None`` (split batch-leading tensors along dim 0), a pair
            ``(args_spec, kwargs_spec)`` of ``TensorChunkSpec`` / ``Replicate`` markers,
            or ``f(args, kwargs, num_microbatch)`` returning ``(args_list, kwargs_list)``
            or ``[(args, kwargs), ...]`` (see ``roundpipe_core.batch``).
        split_label: ``None`` (split like the inputs), a spec mirroring the label, or
            ``f(label, num_microbatch) -> [label, ...]``.
        merge_output: ``None``/``True`` (concatenate along dim 0, average 0-dim tensors),
            a spec of ``TensorChunkSpec`` / ``Replicate`` / reducers, ``False`` (one
            ``RoundPipePackedData`` per leaf) or ``f([output, ...]) -> output``.
        execute_plan: a ``ModelExecutePlan`` (default: planned automatically).
    """

    requires_grad: bool | None = None
    output_device: torch.device | str | None = None
    preserve_rng_state: bool | None = None
    recompute_grain: RecomputeGrain | str | None = None
    num_microbatch: int | None = None
    split_input: Callable[..., Any] | tuple[Any, Any] | None = None
    split_label: Any = None
    merge_output: Any = None
    execute_plan: ModelExecutePlan | None = None

    def merged_over(self, base: RoundPipeRunConfig) -> RoundPipeRunConfig:
        """This config with its ``None`` fields taken from ``base``."""
        mine = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(base, **{k: v for k, v in mine.items() if v is not None})


def check_run_config(cfg: object, name: str = "run_config") -> RoundPipeRunConfig:
    """``cfg`` checked field by field.

    Raises:
        TypeError: ``cfg`` is not a ``RoundPipeRunConfig``, or a field has the wrong type.
        ValueError: a field has a value outside its choices.
    """
    if not isinstance(cfg, RoundPipeRunConfig):
        raise TypeError(f"{name} must be a RoundPipeRunConfig, got {type(cfg).__name__}")
    if cfg.recompute_grain is not None:
        parse_kind(RecomputeGrain, cfg.recompute_grain, "recompute_grain")
    if cfg.num_microbatch is not None:
        check_int(cfg.num_microbatch, "num_microbatch")
    check_flag(cfg.requires_grad, "requires_grad", none="grad mode decides")
    check_flag(cfg.preserve_rng_state, "preserve_rng_state", none="the model's, else True")
    check_run_specs(cfg.split_input, cfg.split_label, cfg.merge_output)
    if cfg.output_device is not None:
        output_device(cfg.output_device)
    if cfg.execute_plan is not None and not isinstance(cfg.execute_plan, ModelExecutePlan):
        raise TypeError(
            f"execute_plan must be a ModelExecutePlan, got {type(cfg.execute_plan).__name__}"
        )
    return cfg


def output_device(value: object) -> torch.device:
    """``value`` as a ``torch.device``.

    Raises:
        ValueError: it names no device (``"nonsense"``) or none this machine has
            (``"cuda:0"`` without CUDA), so the call fails before compute.
    """
    device = value if isinstance(value, torch.device) else None
    if isinstance(value, str):
        with contextlib.suppress(RuntimeError):
            device = torch.device(value)
    if device is None:
        raise ValueError(
            "output_device must be a torch.device or a device string such as 'cpu' or "
            f"'cuda:0', got {value!r}"
        )
    # one this machine has (cuda:0 without CUDA would fail only after the call computed)
    if device.type in ("cpu", "meta"):
        return device
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        raise ValueError(
            f"output_device={str(device)!r}: this machine has no {device.type} device; pass "
            "'cpu' (the default) or a device it has"
        )
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise ValueError(
            f"output_device={str(device)!r}: this machine has {count()} {device.type} "
            f"device(s) (indices 0..{count() - 1}); pass one of them or 'cpu'"
        )
    return device
