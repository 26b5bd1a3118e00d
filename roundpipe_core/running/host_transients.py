"""Host memory a run holds beside its state: the lines of the host-memory budget that
are neither weights nor optimizer state (:mod:`.host_memory` adds them up).

* :func:`mapped_file_bytes` -- the pages of a file the weights are mapped from. A
  Hugging Face checkpoint is read through ``mmap`` (safetensors, ``torch.load(mmap=True)``)
  and the parameters that are not converted on loading (a quantized model's embeddings,
  LM head and norms) stay views of that mapping; so the mapping stays open for the
  whole run, and every page of the file that was read -- loading a 4-bit model reads
  the whole bf16 checkpoint to quantize it -- stays in the process's resident set.
  Those pages are clean file cache (``MemAvailable`` counts them, the kernel drops them
  under pressure), but ``ps``, ``VmRSS`` and a cgroup's ``memory.current`` show them.
* :func:`worker_activations` -- what autograd saves inside a stage while a CPU worker
  runs it (on a CPU worker the "device" is host memory): per worker, one microbatch's
  saved tensors of the largest stage it runs with autograd (a fused or backward job),
  with the loss's transient where the stage computes the loss.
* :func:`dequantized_bytes` -- a bitsandbytes 4-bit layer on a CPU worker dequantizes
  its weight in every forward and backward (``MatMul4Bit``) and frees it right after:
  per worker, the largest such weight, in its quant state's dtype plus a copy in the
  layer's compute dtype where the two differ.

All three are 0 where they do not apply (no mapped file; a CUDA pool, whose
activations and dequantized weights are in GPU memory).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "MappedFiles",
    "check_layer_bytes",
    "dequantized_bytes",
    "layer_dequantized_bytes",
    "mapped_file_bytes",
    "worker_activations",
]


@dataclass(frozen=True)
class MappedFiles:
    """The file mappings that tensors live in.

    Attributes:
        extra: bytes of those mappings beyond the tensors inside them (what the
            resident set reaches once every page has been read).
        resident: bytes of those mappings resident now.
        inside: bytes of the tensors inside them (counted by the weights line).
    """

    extra: int = 0
    resident: int = 0
    inside: int = 0


def _file_mappings() -> list[tuple[int, int, str, str]]:
    """``(start, end, "start-end", file)`` of this process's file-backed mappings, by
    start (``file``: device and inode); empty where ``/proc/self/maps`` cannot be read."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                # address perms offset dev inode [path]: inode 0 is anonymous memory
                if len(fields) < 6 or fields[4] == "0" or fields[5].startswith("["):
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi, fields[0], f"{fields[3]}:{fields[4]}"))
    except (OSError, ValueError):
        return []
    out.sort()
    return out


def _resident_of(ranges: set[str]) -> int:
    """Resident bytes (``Rss``) of the mappings ``ranges`` (their ``/proc/self/maps``
    address fields), from ``/proc/self/smaps``."""
    total = 0
    current = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    current = head in ranges
                elif current and head == "Rss:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def mapped_file_bytes(tensors: Iterable[torch.Tensor]) -> MappedFiles:
    """The files the storages of ``tensors`` are mapped from (see the module docstring):
    all of each such file's mappings (the kernel may split one ``mmap`` into several),
    each storage once. All zeros off Linux or without mapped tensors."""
    storages: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.is_meta:
            continue
        s = t.untyped_storage()
        if s.data_ptr():
            storages[s.data_ptr()] = s.nbytes()
    if not storages:
        return MappedFiles()
    maps = _file_mappings()
    starts = [m[0] for m in maps]
    inside: dict[str, int] = {}
    for ptr, nbytes in storages.items():
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0 or ptr >= maps[i][1]:
            continue  # anonymous memory: the usual case
        inside[maps[i][3]] = inside.get(maps[i][3], 0) + nbytes
    if not inside:
        return MappedFiles()
    ranges = {key for _, _, key, file in maps if file in inside}
    size: dict[str, int] = {}
    for lo, hi, _, file in maps:
        if file in inside:
            size[file] = size.get(file, 0) + hi - lo
    extra = sum(max(size[f] - inside[f], 0) for f in inside)
    return MappedFiles(extra=extra, resident=_resident_of(ranges), inside=sum(inside.values()))


def fused_jobs_by_device(rp: Any, plan: Any, num_microbatch: int) -> list[list[Any]]:
    """Each device's jobs of one "fused" call under ``plan``, as the run schedules them
    once it has learned which stages draw random numbers: a one-stage plan's replicas
    (``planner.most_fused_replicas``) each on its own worker, each holding its own
    gradients and activations -- the peak a budget must count."""
    from ..planning.planner import most_fused_replicas
    from ..planning.schedule import build_schedule, jobs_by_device

    replicas = most_fused_replicas(rp, plan, num_microbatch)
    jobs = build_schedule(plan, "fused", rp.num_devices, num_microbatch, replicas=replicas)
    return jobs_by_device(jobs, rp.num_devices)


def _autograd_jobs(rp: Any, plan: Any, num_microbatch: int) -> list[list[Any]]:
    """Each device's fused and backward jobs of one "fused" call under ``plan`` (the
    jobs that run with autograd; forward jobs of a training call save only their input)."""
    from ..planning.schedule import FORWARD

    return [
        [j for j in q if j.kind != FORWARD] for q in fused_jobs_by_device(rp, plan, num_microbatch)
    ]


def check_layer_bytes(value: Sequence[float] | None) -> list[float] | None:
    """``value`` as a list of floats, or ``None``; ValueError unless byte counts >= 0."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and b >= 0 for b in items
    ):
        raise ValueError(
            "layer_activation_bytes must be a list of byte counts >= 0, one per layer, "
            f"got {value!r}"
        )
    return [float(b) for b in items]


def worker_activations(
    rp: Any, plan: Any, num_microbatch: int, layer_bytes: Sequence[float] | None
) -> int:
    """Bytes of saved activations the CPU workers hold together while they run stages:
    per worker, the largest sum of ``layer_bytes`` (one microbatch's saved tensors per
    layer, the last layer's with the loss's transient: ``RoundPipe.layer_activation_bytes``)
    over the stages it runs with autograd. A stage runs its microbatches one after the
    other, so one microbatch's graph is alive at a time. 0 without ``layer_bytes``."""
    if not layer_bytes:
        return 0
    total = 0
    for queue in _autograd_jobs(rp, plan, num_microbatch):
        peak = 0.0
        for job in queue:
            peak = max(peak, sum(float(layer_bytes[k]) for k in job.layers))
        total += int(peak)
    return total


def _dtype_size(dtype: Any) -> int:
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 0


def layer_dequantized_bytes(layer: nn.Module) -> int:
    """The largest dequantized weight of ``layer``'s bitsandbytes 4-bit modules: the
    weight's count x its quant state's dtype size, plus x the module's compute dtype
    size where it differs (``dequantize_4bit(...).to(compute dtype)`` holds both)."""
    largest = 0
    for m in layer.modules():
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        shape = getattr(state, "shape", None)
        if state is None or not isinstance(shape, (tuple, list, torch.Size)):
            continue
        n = 1
        for d in shape:
            n *= int(d)
        dq = _dtype_size(getattr(state, "dtype", None))
        compute = _dtype_size(getattr(m, "compute_dtype", None))
        largest = max(largest, n * (dq + (compute if compute and compute != dq else 0)))
    return largest


def dequantized_bytes(rp: Any, plan: Any, num_microbatch: int) -> int:
    """Bytes of dequantized 4-bit weights the CPU workers hold together: per worker, the
    largest :func:`layer_dequantized_bytes` over the layers of the stages it runs (one
    weight at a time: each is freed after its matmul)."""
    per_layer = [layer_dequantized_bytes(layer) for layer in rp.layers]
    if not any(per_layer):
        return 0
    return sum(
        max((per_layer[k] for job in queue for k in job.layers), default=0)
        for queue in fused_jobs_by_device(rp, plan, num_microbatch)
    )
