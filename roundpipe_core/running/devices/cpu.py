"""CPU backend: a thread that plays a device.

Its memory is the host's. An upload hands the stage aliases of the host parameters
(``lend_in``; buffers are still copied; a newer weight version is copied into the host
only after the stage is released, ``transfer.upload_job``) -- then it
runs the stage, hands what the stage produced (outputs, gradients) back without
copying it, and keeps a ledger of the bytes a device would hold.
All model code of the CPU backend runs under one process-wide lock: the CPU
random generator is shared by all threads, so only serialised compute gives
each (layer, microbatch) a well-defined RNG state to save and replay — and
intra-op threads already use every core.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..host_memory import available_host_memory
from .base import Worker

__all__ = ["CPUWorker", "DEFAULT_CPU_DEVICE_MEMORY_GB", "cpu_device_memory_bytes"]

_CPU_COMPUTE_LOCK = threading.RLock()
_CPU_GENERATOR = torch.default_generator

#: Memory a CPU worker reports to the planner (the default model_memory_limit
#: is 60% of it). Override with env ROUNDPIPE_CPU_DEVICE_MEMORY_GB.
DEFAULT_CPU_DEVICE_MEMORY_GB = 8.0
_MEMORY_ENV = "ROUNDPIPE_CPU_DEVICE_MEMORY_GB"


def cpu_device_memory_bytes(share: int = 1) -> int:
    """Bytes a CPU worker offers: env ``ROUNDPIPE_CPU_DEVICE_MEMORY_GB`` (GiB) if set, else
    8 GiB or, when less, this worker's ``1/share`` of the host memory available now.

    A CPU worker's stage copies come out of the same host memory as the model state, so
    the default must not promise every worker 8 GiB of a machine that the state has
    already filled.

    Raises:
        ValueError: if the variable is not a positive, finite number.
    """
    raw = os.environ.get(_MEMORY_ENV, "").strip()
    if not raw:
        default = int(DEFAULT_CPU_DEVICE_MEMORY_GB * 1024**3)
        available = available_host_memory()
        if available is None:
            return default
        return max(1, min(default, available // max(1, share)))
    try:
        gb = float(raw)
    except ValueError:
        gb = math.nan
    # Below one byte the planner could place nothing, so it counts as zero too.
    if not math.isfinite(gb) or gb * 1024**3 < 1:
        raise ValueError(
            f"environment variable {_MEMORY_ENV}={raw!r} must be a positive number of GiB "
            f"(e.g. {_MEMORY_ENV}=8); unset it for the default of {DEFAULT_CPU_DEVICE_MEMORY_GB:g}"
        )
    return int(gb * 1024**3)


def _copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies. Activations and gradients arrive detached already, and
    ``detach()`` costs about half a small clone, so only tensors that require grad pay
    for it."""
    return [t.detach().clone() if t.requires_grad else t.clone() for t in tensors]


def _param_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of parameters (which require grad): made with autograd off, where
    a clone requires no grad, instead of a ``detach()`` per tensor."""
    if not torch.is_grad_enabled():
        return [t.clone() for t in tensors]
    torch._C._set_grad_enabled(False)
    try:
        return [t.clone() for t in tensors]
    finally:
        torch._C._set_grad_enabled(True)


def _aliases_or_copies(
    tensors: Sequence[torch.Tensor], read_only: Sequence[bool]
) -> list[torch.Tensor]:
    """Detached aliases of the read-only tensors (same storage, a tensor object of their
    own that requires no grad), copies of the rest made with autograd off."""
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return [t.detach() if ro else t.clone() for t, ro in zip(tensors, read_only)]
    finally:
        torch._C._set_grad_enabled(enabled)


def _nbytes(t: torch.Tensor) -> int:
    return t.nbytes  # numel() * element_size(), in one call


class CPUWorker(Worker):
    """A thread that plays a device: uploads are copies, the ledger counts their bytes."""

    kind = "cpu"
    time_points_are_seconds = True
    lends_host_tensors = True

    #: How many CPU workers of one pool split the host's free memory (the pool sets it).
    share: int = 1

    def __init__(self, index: int) -> None:
        cpu_device_memory_bytes()  # a bad setting fails when the pool is built, not mid-plan
        super().__init__(index, torch.device("cpu"))

    def copy_in(self, tensors: Sequence[torch.Tensor], channel: str) -> list[torch.Tensor]:
        out = _param_copies(tensors) if channel == "param" else _copies(tensors)
        self.ledger.alloc(sum(map(_nbytes, out)), channel)
        return out

    def lend_in(
        self, tensors: Sequence[torch.Tensor], read_only: Sequence[bool]
    ) -> list[torch.Tensor]:
        # device memory is host memory: a stage that only reads a host tensor computes on
        # it (an alias of its own, so the stage's parameter wrapper and .grad are the
        # stage's); what it may write (buffers) is still copied
        out = _aliases_or_copies(tensors, read_only)
        self.ledger.alloc(sum(map(_nbytes, out)), "param")
        return out

    def wait_channel(self, channel: str) -> None:
        # Copies are synchronous on the CPU backend.
        return None

    def copy_out(
        self, tensors: Sequence[torch.Tensor], channel: str = "download"
    ) -> list[torch.Tensor]:
        # host memory already: what a stage hands out (its outputs, input gradients,
        # losses, buffer copies) is made by this job and not written after it, and every
        # consumer's copy_in copies again before it may write -- a copy here would only be
        # thrown away
        return [t.detach() if t.requires_grad else t for t in tensors]

    def take_out(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # host memory already, and the stage drops them: a copy would only be thrown away
        return [t.detach() if t.requires_grad else t for t in tensors]

    def release(self, tensors: Sequence[torch.Tensor], tag: str) -> None:
        self.ledger.free(sum(map(_nbytes, tensors)), tag)

    def compute(self) -> contextlib.AbstractContextManager:
        return _CPU_COMPUTE_LOCK

    def get_rng_state(self) -> Any:
        return _CPU_GENERATOR.get_state()  # torch.get_rng_state(), without its wrapper

    def set_rng_state(self, state: Any) -> None:
        _CPU_GENERATOR.set_state(state)

    def time_point(self) -> Any:
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1000.0

    def memory_capacity(self) -> int:
        return cpu_device_memory_bytes(self.share)
