"""The host-memory budget of a RoundPipe run, before it starts.

RoundPipe keeps the whole training state in host RAM, so host RAM decides how large a
model a machine can train. :func:`estimate_host_memory` adds up what a run holds at its
peak, line by line (docs/host-memory.md has the measurements):

===================  ====================================================================
weights              parameters and buffers (a quantized layer's packed bytes, quant state)
masters              the optimizer's copies (``optim_dtype``); none for a parameter that is
                     its own master; 1/N of the separate ones sharded over N ranks
gradients            one gradient per master
next gradients       async step with separate masters: the next iteration's gradients
                     arrive while the step still reads these (sharded: 1/N)
optimizer state      states per parameter (:data:`OPTIMIZER_STATES`) x master size (1/N)
pinned buffers       CUDA: slab rounding of ``pin_model="alloc"`` and the download rings
worker stage copies  CPU workers: per worker, what its stage and the prefetched next one
                     copy (buffers, carried quant state, gradients in another dtype)
activations          stage-boundary activations kept for recompute (if given)
mapped file pages    the file the weights are mapped from, beyond the weights in it
worker activations   CPU workers: per worker, one microbatch's saved tensors of its largest
                     autograd stage (``layer_activation_bytes``)
dequantized weights  CPU workers: per worker, its largest 4-bit weight dequantized
collective buffers   several processes: the reduction's (and all-gather's) flat buffers
disk tier buffer     ``offload_dir``: ``buffer_layers`` of the largest layer's records and
                     one master; masters and optimizer state are then 0 and ``disk`` (not
                     in the total) is what the tier's files take
===================  ====================================================================

``process`` is the resident set beyond those lines (interpreter, torch, the data
loader), ``training_code`` what of torch's code the first step pages in. Of the total,
``file_backed`` lies in clean pages of files, which the kernel drops under pressure and
reads back (docs/host-memory.md, "LoRA on a frozen base read from its files").
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import math
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from ..kinds import check_byte_counts, check_flag, check_int
from ..planning.profile import format_bytes
from .carried import carried_tensors, logical_numel
from .devices.memory import pack_slabs, page_size, slab_sizes

__all__ = [
    "HEAP_THRESHOLD_ENV",
    "OPTIMIZER_STATES",
    "TRAINING_CODE_BYTES",
    "HostMemoryBudget",
    "HostMemoryError",
    "MappedFiles",
    "UnknownOptimizerError",
    "available_host_memory",
    "check_host_memory",
    "estimate_host_memory",
    "heap_retention_limited",
    "layer_dequantized_bytes",
    "limit_heap_retention",
    "mapped_file_bytes",
    "note_training_step",
    "optimizer_states_per_param",
    "resident_bytes",
]


class HostMemoryError(ValueError, MemoryError):
    """The run needs more host memory than the machine has available (a configuration
    that cannot work: a ``ValueError``, and a ``MemoryError``)."""


#: Parameter-sized state tensors each optimizer keeps (torch.optim defaults; the scalar
#: ``step`` counters are negligible). Options that add states are handled by
#: :func:`optimizer_states_per_param`.
OPTIMIZER_STATES: dict[str, int] = {
    **dict.fromkeys(("adam", "adamw", "adamax", "nadam", "radam", "sparseadam"), 2),
    **dict.fromkeys(("adadelta", "rprop"), 2),
    **dict.fromkeys(("adagrad", "asgd", "rmsprop"), 1),
    "sgd": 0,
}


# options that add a state each, per optimizer
_OPTION_STATES = {
    "sgd": ("momentum",),
    "adam": ("amsgrad",),
    "adamw": ("amsgrad",),
    "rmsprop": ("momentum", "centered"),
}


class UnknownOptimizerError(ValueError):
    """The state table does not know this optimizer (pass ``optimizer_states``)."""


def optimizer_states_per_param(optimizer: Any) -> int:
    """Parameter-sized state tensors ``optimizer`` keeps per parameter: an instance (its
    options are read: SGD ``momentum``, Adam ``amsgrad``, RMSprop ``momentum``/``centered``),
    a class (or subclass of a known one) or a name such as ``"adamw"``.

    Raises:
        UnknownOptimizerError: (a ``ValueError``) for an optimizer the table does not know.
        TypeError: for anything else.
    """
    defaults: dict[str, Any] = {}
    if isinstance(optimizer, torch.optim.Optimizer):
        name = _known_name(type(optimizer))
        groups = optimizer.param_groups or [optimizer.defaults]
        defaults = {
            k: any(bool(g.get(k)) for g in groups) for k in ("momentum", "amsgrad", "centered")
        }
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = _known_name(optimizer)
    elif isinstance(optimizer, str):
        name = optimizer
    else:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, its class or a name such as 'adamw', "
            f"got {type(optimizer).__name__}"
        )
    key = _key(name)
    if key not in OPTIMIZER_STATES:
        raise UnknownOptimizerError(
            f"no state count known for optimizer {name!r} (known: {', '.join(sorted(OPTIMIZER_STATES))}); "
            "pass optimizer_states=<parameter-sized tensors it keeps per parameter>"
        )
    return OPTIMIZER_STATES[key] + sum(bool(defaults.get(o)) for o in _OPTION_STATES.get(key, ()))


def _key(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _known_name(cls: type) -> str:
    """The name of the first class in ``cls``'s MRO this table knows (a subclass of
    ``torch.optim.SGD`` keeps SGD's state), else ``cls``'s own name."""
    for base in cls.__mro__:
        if _key(base.__name__) in OPTIMIZER_STATES:
            return base.__name__
    return cls.__name__


# The kernels a step runs (backward, the optimizer, the collectives) are clean file pages
# of libtorch_cpu.so, resident from their first run: in the peak RSS, not in what
# check_host_memory asks to allocate (docs/host-memory.md, "The whole process").
#: what a process's first training step pages in of torch's code (12-35 MiB measured)
TRAINING_CODE_BYTES = 40 * 2**20
_stepped = False


def note_training_step() -> None:
    """Record that this process queued an optimizer step (its training code is resident)."""
    global _stepped
    _stepped = True


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page_size()
    except (OSError, ValueError, IndexError):
        return 0


# glibc's heap retention: allocations of at least its mmap threshold get a mapping of
# their own, returned when freed; but after the first such block is freed glibc raises the
# threshold to its size (up to 32 MiB), and tensors that size then come from heaps that
# stay resident after free. A sharded rank, which drops and re-makes its gradients every
# step, so peaks above its budget. The collectives keep their flat buffers for that
# reason; limit_heap_retention fixes the threshold at the price of a page fault per 4 KiB
# of every large tensor (1.1-3x slower steps on CPU workers), so it is opt-in
# (docs/multi-node.md, sharded host state).
#: glibc's own variable: a run launched with it keeps its value
HEAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
_M_MMAP_THRESHOLD = -3  # <malloc.h>
_lock = threading.Lock()
_applied: int | None = None


def limit_heap_retention(threshold: int = 64 * 1024) -> bool:
    """Serve allocations of ``threshold`` bytes or more with their own mappings, so
    freeing a tensor returns its memory to the system (above), process-wide, for good;
    nothing where ``MALLOC_MMAP_THRESHOLD_`` is set or off glibc. Idempotent; whether the
    setting is in effect after the call."""
    global _applied
    if os.environ.get(HEAP_THRESHOLD_ENV):
        return True
    with _lock:
        if _applied == threshold:
            return True
        try:
            mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
        except (OSError, AttributeError, TypeError):
            return False  # not glibc (musl, macOS): nothing to tune
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        if mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
            return False
        _applied = threshold
        return True


def heap_retention_limited() -> bool:
    """Whether the mmap threshold is fixed (at launch, or by :func:`limit_heap_retention`)."""
    return bool(os.environ.get(HEAP_THRESHOLD_ENV)) or _applied is not None


@dataclass(frozen=True)
class MappedFiles:
    """The file mappings tensors live in: bytes ``extra`` beyond the tensors (what the
    resident set reaches once every page was read), ``resident`` now, and ``inside``
    (the tensors', counted by the weights line)."""

    extra: int = 0
    resident: int = 0
    inside: int = 0


def _file_mappings() -> list[tuple[int, int, str, str]]:
    """``(start, end, "start-end", "dev:inode")`` of this process's file-backed mappings
    by start (empty where ``/proc/self/maps`` cannot be read)."""
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
    """Resident bytes of the mappings with these ``/proc/self/maps`` address fields."""
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
    """The files the storages of ``tensors`` are mapped from, all of each one's mappings
    (the kernel may split an ``mmap``), each storage once; zeros off Linux. Parameters not
    converted on loading stay views of a checkpoint read through ``mmap`` (a 4-bit
    model's embeddings and head): every page read stays resident, clean cache that
    ``MemAvailable`` counts but RSS and a cgroup show."""
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


def _dtype_size(dtype: Any) -> int:
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0


def layer_dequantized_bytes(layer: nn.Module) -> int:
    """The largest dequantized weight of ``layer``'s bitsandbytes 4-bit modules: its count
    x its quant state's dtype size (+ the compute dtype's where it differs:
    ``dequantize_4bit(...).to(compute dtype)`` holds both)."""
    largest = 0
    for m in layer.modules():
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        shape = getattr(state, "shape", None)
        if state is None or not isinstance(shape, (tuple, list, torch.Size)):
            continue
        n = math.prod(int(d) for d in shape)
        dq = _dtype_size(getattr(state, "dtype", None))
        compute = _dtype_size(getattr(m, "compute_dtype", None))
        largest = max(largest, n * (dq + (compute if compute and compute != dq else 0)))
    return largest


def _unique_storage_bytes(tensors: Iterable[torch.Tensor], skip: set[int] | None = None) -> int:
    """Bytes of the distinct host storages behind ``tensors`` (tied weights once); a meta
    tensor counts as the host tensor it stands for, each object once (no address)."""
    seen: set[Any] = set(skip or ())
    total = 0
    for t in tensors:
        if t.is_meta:
            if ("meta", id(t)) not in seen:
                seen.add(("meta", id(t)))
                total += t.untyped_storage().nbytes()
            continue
        if t.device.type != "cpu":
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen or key == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _line(name: str) -> Any:
    """A budget field that is a line of its table, ``name`` there (table order: the fields')."""
    return field(default=0, metadata={"line": name})


@dataclass(frozen=True)
class HostMemoryBudget:
    """Host bytes a run needs at its peak, by line (see the module docstring).

    Attributes:
        num_params: parameters of the model (tied ones once).
        weights ... disk: bytes of each line (:meth:`rows`; ``disk`` is not in the total).
        already_allocated: bytes of the lines that existed at the estimate (weights, a
            RoundPipe's masters); only the rest has to fit into available memory.
        mapped_weights: of the weights, frozen views of a mapped file (``file_backed``).
        optimizer: the optimizer the state line assumes, with its states per parameter.
        process / training_code: see the module docstring (0 where RSS cannot be read).
    """

    num_params: int
    weights: int = _line("weights")
    masters: int = _line("masters")
    gradients: int = _line("gradients")
    next_gradients: int = _line("next gradients (async step)")
    optimizer_state: int = _line("optimizer state")
    pinned: int = _line("pinned buffers")
    worker_copies: int = _line("worker stage copies")
    activations: int = _line("activations")
    mapped_files: int = _line("mapped file pages")
    worker_activations: int = _line("worker activations")
    dequantized: int = _line("dequantized weights")
    collective_buffers: int = _line("collective buffers")
    tier_buffer: int = _line("disk tier buffer")
    already_allocated: int = 0
    optimizer: str = ""
    process: int = 0
    training_code: int = 0
    disk: int = 0
    mapped_weights: int = 0

    @property
    def total(self) -> int:
        """All lines added up: the run's peak host memory for its state."""
        return sum(b for _, b in self.rows())

    @property
    def file_backed(self) -> int:
        """Of the total, clean pages of mapped files, which need not stay resident."""
        return self.mapped_weights + self.mapped_files

    @property
    def anonymous(self) -> int:
        """Of the total, what must stay resident: ``total - file_backed``."""
        return self.total - self.file_backed

    @property
    def process_peak(self) -> int:
        """The whole process's predicted peak RSS: ``total + process + training_code``."""
        return self.total + self.process + self.training_code

    @property
    def to_allocate(self) -> int:
        """What is not allocated yet: this must fit into the available memory."""
        return max(self.total - self.already_allocated, 0)

    @property
    def bytes_per_param(self) -> float:
        return self.total / max(self.num_params, 1)

    def rows(self) -> list[tuple[str, int]]:
        """``(line, bytes)`` in table order."""
        state = f"optimizer state ({self.optimizer})" if self.optimizer else "optimizer state"
        return [
            (state if f.name == "optimizer_state" else f.metadata["line"], getattr(self, f.name))
            for f in fields(self)
            if f.metadata
        ]

    def summary(self, available: int | None = None) -> str:
        """One line for a run's set-up output: what it needs against ``available`` bytes
        (:func:`available_host_memory`; ``None``: unknown). ``str(budget)``: the table."""
        need = (
            f"{format_bytes(self.process_peak)} for the whole process"
            if self.process
            else f"{format_bytes(self.total)} for its state"
        )
        have = (
            f"{format_bytes(available)} available" if available is not None else "available unknown"
        )
        return f"host memory: needs {need} ({format_bytes(self.to_allocate)} still to allocate), {have}"

    def __str__(self) -> str:
        n = max(self.num_params, 1)
        rows = [*self.rows(), ("total", self.total)]
        width = max(len(name) for name, _ in rows)
        lines = [f"host memory budget for {self.num_params:,} parameters"]
        lines += [
            f"  {name:<{width}}  {format_bytes(b):>11}  {b / n:6.2f} B/param" for name, b in rows
        ]
        tail = [("still to allocate", self.to_allocate)]
        if self.file_backed:
            tail += [("of it file-backed", self.file_backed), ("of it anonymous", self.anonymous)]
        if self.disk:
            tail.append(("on disk (offload_dir)", self.disk))
        if self.process:
            tail.append(("+ process (libraries)", self.process))
            if self.training_code:
                tail.append(("+ training code (first step)", self.training_code))
            tail.append(("= whole process", self.process_peak))
        lines += [f"  {name:<{width}}  {format_bytes(b):>11}" for name, b in tail]
        return "\n".join(lines)


def _masters_of(
    model: nn.Module,
) -> tuple[nn.Module, list[tuple[nn.Parameter, nn.Parameter]] | None]:
    """(wrapped module, [(param, master)]) of a RoundPipe; (model, None) for a plain one."""
    masters = getattr(model, "masters", None)
    inner = getattr(model, "model", None)
    entries = getattr(masters, "entries", None)
    if isinstance(entries, list) and isinstance(inner, nn.Module) and hasattr(model, "pool"):
        return inner, [(p, m) for _, p, m in entries]
    return model, None


def _existing_state_bytes(masters: Iterable[torch.Tensor], optimizers: list | None) -> int:
    """Bytes of the gradients and optimizer state that exist already (a resumed run)."""
    grads = _unique_storage_bytes(m.grad for m in masters if m.grad is not None)
    states = [
        v
        for o in optimizers or []
        for st in o.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    ]
    return grads + _unique_storage_bytes(states)


def _worker_lines(
    rp: Any,
    plan: Any,
    num_microbatch: int,
    master_dtype: dict[int, Any],
    layer_acts: Sequence[float] | None,
) -> tuple[int, int, int]:
    """The CPU workers' (stage copies, activations, dequantized weights), each summed over
    the workers of each one's peak over its jobs of one "fused" call under ``plan`` with
    the most replicas the run may use (module docstring; ``master_dtype``: per parameter
    id, a gradient in another dtype is held beside its conversion).
    """
    from ..planning.planner import most_fused_replicas
    from ..planning.schedule import FORWARD, build_schedule, jobs_by_device

    replicas = most_fused_replicas(rp, plan, num_microbatch)
    jobs = build_schedule(plan, "fused", rp.num_devices, num_microbatch, replicas=replicas)
    lends = all(getattr(w, "lends_host_tensors", False) for w in rp.pool.workers)
    layer_bytes: list[int] = []
    layer_grads: list[int] = []
    replica_grads: list[int] = []
    for layer in rp.layers:
        params = list({id(p): p for p in layer.parameters()}.values())
        copied = list(layer.buffers()) + carried_tensors(layer)
        layer_bytes.append(_unique_storage_bytes(copied if lends else params + copied))
        converted = [not lends or master_dtype.get(id(p), p.dtype) != p.dtype for p in params]
        trained = [(p, c) for p, c in zip(params, converted) if p.requires_grad]
        layer_grads.append(sum(p.nbytes for p, c in trained if c))
        replica_grads.append(sum(p.nbytes for p, _ in trained))
    dequantized = [layer_dequantized_bytes(layer) for layer in rp.layers]
    copies = acts = dq = 0
    for queue in jobs_by_device(jobs, rp.num_devices):
        peak = 0
        for i, job in enumerate(queue):
            held = sum(layer_bytes[k] for k in job.layers)
            if job.kind != FORWARD:
                # a replica after the first holds gradients of its own until the last is in
                grads = replica_grads if job.replica > 0 else layer_grads
                held += sum(grads[k] for k in job.layers)
            if i + 1 < len(queue):
                held += sum(layer_bytes[k] for k in queue[i + 1].layers)
            peak = max(peak, held)
        copies += peak
        if layer_acts:  # forward jobs of a training call save only their input
            saved = [
                sum(float(layer_acts[k]) for k in j.layers) for j in queue if j.kind != FORWARD
            ]
            acts += int(max(saved, default=0.0))
        dq += max((dequantized[k] for job in queue for k in job.layers), default=0)
    return copies, acts, dq


def estimate_host_memory(
    model: nn.Module,
    *,
    optimizer: Any = "adamw",
    optimizer_states: int | None = None,
    optim_dtype: torch.dtype | None = None,
    num_microbatch: int | None = None,
    activation_bytes_per_microbatch: int = 0,
    plan: Any = None,
    shared_masters: bool = False,
    state_shards: int = 1,
    async_step: bool | None = None,
    layer_activation_bytes: Sequence[float] | None = None,
    collective_buffers: int = 0,
    offload_dir: bool = False,
    buffer_layers: int = 3,
) -> HostMemoryBudget:
    """The host bytes a training run of ``model`` needs at its peak (see the module docstring).

    Args:
        model: a built ``RoundPipe`` (its masters, pool, pinning and "fused" plan are read),
            or a plain module (weights, separate masters, gradients, optimizer state only).
        optimizer: instance, class or name (:func:`optimizer_states_per_param`), or a list
            of optimizer instances, each counting state for the parameters it holds.
        optimizer_states: parameter-sized states per parameter; overrides ``optimizer``.
        optim_dtype: master dtype for a plain module (default: the model's dtype).
        num_microbatch: microbatches per call (default: what the RoundPipe's calls run,
            :func:`~roundpipe_core.planning.plan.default_num_microbatch`: devices + 1 on
            GPUs, 1 or one per worker on CPU workers; 1 for a plain module).
        activation_bytes_per_microbatch: bytes of one stage-boundary activation of one
            microbatch, kept per forward stage boundary and microbatch for recompute.
        plan: the "fused" plan to budget the workers for (default: the RoundPipe's).
        shared_masters: for a plain module: a trainable parameter already in
            ``optim_dtype`` is its own master (``RoundPipe(shared_masters=True)``).
        state_shards: ranks the optimizer state and the separate masters are sharded over
            (``DataParallel(shard_host_state=True)``); the gradients stay whole (a
            backward produces all of them before they are reduced to their owners).
        async_step: whether the step overlaps the next iteration (the "next gradients"
            line). Default: a RoundPipe with a separate master and ``state_shards == 1``;
            False for a plain module.
        layer_activation_bytes: CPU workers: one microbatch's saved activation bytes per
            layer (default: the RoundPipe's ``layer_activation_bytes``, measured by its
            first training call).
        collective_buffers: the bytes ``DataParallel.kept_buffer_bytes`` reports.
        offload_dir: for a plain module: masters and optimizer state on disk (a
            RoundPipe's own disk tier is read); ``buffer_layers``: the tier's resident layers.

    Raises:
        TypeError / ValueError: for a non-module, a negative byte count or an
            unknown optimizer without ``optimizer_states``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a RoundPipe, got {type(model).__name__}")
    if optimizer_states is not None:
        check_int(optimizer_states, "optimizer_states", minimum=0)
    check_int(state_shards, "state_shards", why="ranks")
    check_flag(shared_masters, "shared_masters")
    check_flag(async_step, "async_step", none="the masters decide")
    check_int(activation_bytes_per_microbatch, "activation_bytes_per_microbatch", 0, "bytes")
    layer_acts = layer_activation_bytes
    if layer_acts is not None:
        layer_acts = check_byte_counts(layer_acts, "layer_activation_bytes")
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else None
    held_state = 0  # a list's: each optimizer keeps state for the parameters (masters) it holds
    if optimizer_states is not None:
        states, opt_label = optimizer_states, f"{optimizer_states}/param"
    elif optimizers is not None:
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError(
                "optimizer given as a list must hold torch.optim.Optimizer instances (their parameters "
                f"decide which masters carry state), got {[type(o).__name__ for o in optimizers]}"
            )
        states = 0
        counts = [optimizer_states_per_param(o) for o in optimizers]
        opt_label = ", ".join(f"{type(o).__name__}: {n}/param" for o, n in zip(optimizers, counts))
        for o, n in zip(optimizers, counts):
            held = {id(p): p for g in o.param_groups for p in g["params"]}
            held_state += n * sum(p.nbytes for p in held.values())
    else:
        states = optimizer_states_per_param(optimizer)
        name = optimizer if isinstance(optimizer, (str, type)) else type(optimizer)
        opt_label = f"{getattr(name, '__name__', name)}: {states}/param"

    inner, pairs = _masters_of(model)
    params = {id(p): p for p in inner.parameters()}
    weight_tensors = [*inner.parameters(), *inner.buffers()]
    # a quantized model's weights: packed parameters, and the quant state beside them
    state_tensors = weight_tensors + carried_tensors(inner)
    weights = _unique_storage_bytes(state_tensors)
    mapped = mapped_file_bytes(state_tensors)
    # frozen tensors in a mapping stay there (a trained one is written: copy-on-write)
    frozen_mapped = mapped_file_bytes([t for t in state_tensors if not t.requires_grad]).inside
    num_params = sum(logical_numel(p) for p in params.values())
    weight_ptrs = {t.untyped_storage().data_ptr() for t in weight_tensors}
    next_gradients = 0
    if pairs is not None:
        mlist = list({id(m): m for _, m in pairs}.values())
        masters = _unique_storage_bytes(mlist, skip=weight_ptrs)
        master_numel_bytes = sum(m.nbytes for m in mlist)
        already = weights + masters  # (a master a shard released: a few bytes)
        separate = {id(m): m for p, m in pairs if m is not p}
        share = -(-sum(m.nbytes for m in separate.values()) // state_shards)  # this rank's
        # (sharded, the default step is synchronous: DataParallel.attach's default; the
        # strategies pass their own)
        is_async = async_step if async_step is not None else bool(separate) and state_shards == 1
        if state_shards > 1:  # its share's (the others' are released)
            masters = share
        if is_async:
            # a shared master's step is always synchronous: only separate ones overlap;
            # sharded, the step in flight reads this rank's share of them only
            next_gradients = share
    else:
        trainable = [p for p in params.values() if p.requires_grad]
        itemsize = {id(p): _dtype_size(optim_dtype or p.dtype) for p in trainable}
        master_numel_bytes = sum(p.numel() * itemsize[id(p)] for p in trainable)
        # a parameter that is its own master (same dtype, on the host) adds nothing
        masters = sum(
            p.numel() * itemsize[id(p)]
            for p in trainable
            if not (
                shared_masters
                and (optim_dtype or p.dtype) == p.dtype
                and p.device.type in ("cpu", "meta")  # a meta model stands for a host one
            )
        )
        already = weights
        masters = -(-masters // state_shards)  # its share
        if async_step:
            next_gradients = masters  # a gradient per separate master of its share
    gradients = master_numel_bytes
    # this rank's share (rounded up)
    optimizer_state = -(-(states * master_numel_bytes + held_state) // state_shards)

    pinned = worker_copies = activations = worker_acts = dequantized = 0
    # a RoundPipe's pool side; an AutoRoundPipe's units plan their calls each on their own
    # (no one plan to read): its budget counts weights, masters and optimizer state only
    if pairs is not None and callable(getattr(type(model), "num_microbatch_for", None)):
        rp: Any = model
        if plan is None:
            plan = rp.plan_for("fused")
        m = rp.num_microbatch_for(num_microbatch)
        if rp.pool.is_cuda:
            pinned = _cuda_pinned(rp)
        else:
            if layer_acts is None:
                layer_acts = getattr(rp, "layer_activation_bytes", None)
            if layer_acts is not None and len(layer_acts) != rp.num_layers:
                raise ValueError(
                    f"layer_activation_bytes must hold one number per layer ({rp.num_layers}), "
                    f"got {len(layer_acts)}"
                )
            master_dtype = {id(p): mm.dtype for p, mm in pairs}
            worker_copies, worker_acts, dequantized = _worker_lines(
                rp, plan, m, master_dtype, layer_acts
            )
        activations = activation_bytes_per_microbatch * m * max(len(plan.fwd_plan), 1)
    elif activation_bytes_per_microbatch:
        activations = activation_bytes_per_microbatch * (num_microbatch or 1)
    # the mapped pages resident now exist already; mapped weights not read yet do not
    already += mapped.resident - mapped.inside
    resident = resident_bytes()
    existing = _existing_state_bytes([m for _, m in pairs or []], optimizers)
    tier_buffer = disk = 0
    tier = getattr(model, "disk_tier", None) if pairs is not None else None
    if tier is not None or (offload_dir and pairs is None):
        tier_buffer, disk = _tier_bytes(inner, tier, states, master_numel_bytes, buffer_layers)
        masters = optimizer_state = 0  # (the gradients stay resident, the next ones too)
        already = weights
    return HostMemoryBudget(
        num_params=num_params,
        weights=weights,
        masters=masters,
        gradients=gradients,
        next_gradients=next_gradients,
        optimizer_state=optimizer_state,
        pinned=pinned,
        worker_copies=worker_copies,
        activations=activations,
        collective_buffers=collective_buffers,
        already_allocated=already,
        optimizer=opt_label,
        process=max(resident - already - existing, 0) if resident else 0,
        training_code=TRAINING_CODE_BYTES if resident and not _stepped else 0,
        mapped_files=mapped.extra,
        worker_activations=worker_acts,
        dequantized=dequantized,
        tier_buffer=tier_buffer,
        disk=disk,
        mapped_weights=frozen_mapped,
    )


def _tier_bytes(
    inner: nn.Module, tier: Any, states: int, master_bytes: int, buffer_layers: int
) -> tuple[int, int]:
    """(resident, on disk) of the disk tier: a built one's bound and files; for a plain
    module ``buffer_layers`` of its largest layer's page-padded records (fp32 master +
    states), and two slots of every record."""
    trainable = [p for p in inner.parameters() if p.requires_grad]
    largest_master = max((p.numel() * 4 for p in trainable), default=0)
    if tier is not None:
        return tier.limit + largest_master, tier.disk_bytes
    page = 4096
    layers = list(inner.children()) if isinstance(inner, nn.Sequential) else [inner]
    layer_records = [
        sum((p.numel() * 4 + page) * (1 + states) for p in layer.parameters() if p.requires_grad)
        for layer in layers
    ]
    per_slot = master_bytes * (1 + states) + len(trainable) * (1 + states) * page
    return buffer_layers * max(layer_records, default=0) + largest_master, 2 * per_slot


def _cuda_pinned(rp: Any) -> int:
    """Pinned host bytes beyond the weights: the "alloc" slabs' rounding, the rings."""
    extra = 0
    if rp.pin_model == "alloc":
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage() for t in rp.model.parameters()
        }
        sizes = [s.nbytes() for s in storages.values()]
        extra += max(sum(slab_sizes(sizes, pack_slabs(sizes))) - sum(sizes), 0)
    return extra + sum(worker.pinned_download_bytes() for worker in rp.pool.workers)


def available_host_memory() -> int | None:
    """Bytes this process can still allocate: ``psutil``'s available memory (else
    ``MemAvailable``), capped by a cgroup v2 ``memory.max``; ``None`` where unknown."""
    avail: int | None = None
    try:
        import psutil  # type: ignore[import-untyped]

        avail = int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - not installed or unsupported: fall back
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        avail = int(line.split()[1]) * 1024
                        break
        except OSError:
            avail = None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = int(limit) - int(f.read().strip())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def check_host_memory(
    budget: HostMemoryBudget, available: int | None = None, headroom: float = 0.05
) -> None:
    """Raise :class:`HostMemoryError` (with the table) if what the run still has to
    allocate does not fit into ``available`` bytes (default :func:`available_host_memory`;
    unknown: nothing checked) less ``headroom``, the fraction left for everything else
    (data loading, the page cache; ``ValueError`` outside [0, 1))."""
    if not isinstance(headroom, (int, float)) or not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    # an escape hatch for machines where "available" understates what works (swap, overcommit)
    if os.environ.get("ROUNDPIPE_SKIP_MEMORY_CHECK", "").strip() not in ("", "0"):
        return
    if available is None:
        available = available_host_memory()
        if available is None:
            return
    usable = int(available * (1.0 - headroom))
    if budget.to_allocate <= usable:
        return
    raise HostMemoryError(
        f"this run needs {format_bytes(budget.to_allocate)} more host memory, but only {format_bytes(available)} is "
        f"available ({format_bytes(usable)} after {headroom:.0%} headroom).\n{budget}\n"
        "Reduce it: a lower-precision model (bf16 weights), optim_dtype equal to the model's dtype, "
        "an optimizer with fewer states (SGD), fewer CPU workers or smaller stages, or a machine "
        "with more memory. Set ROUNDPIPE_SKIP_MEMORY_CHECK=1 to try anyway."
    )
