"""Checks of the RoundPipe strategies' constructor arguments (Trainer and Fabric): each
wrong value is a ``TypeError`` / ``ValueError`` that names the argument and the fix."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision

__all__ = [
    "parse_dtype",
    "check_bool",
    "check_choice",
    "check_num_microbatch",
    "check_type",
    "check_plugins",
    "check_pool_devices",
    "crowded_node",
    "crowded_node_error",
    "not_launched_error",
]

# the Lightning strategy's logger: what the single-worker hint always went to
log = logging.getLogger("roundpipe_lightning._setup")


_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "double": torch.float64,
}


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.float32`` or a name ("float32", "torch.bfloat16", "bf16") -> dtype (YAML/CLI friendly)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(
            f"optim_dtype={value!r} is not a floating dtype name; use e.g. 'float32', 'bfloat16' or 'float16'"
        )
    raise TypeError(
        f"optim_dtype must be a torch.dtype, a dtype name or None, got {type(value).__name__}"
    )


def check_bool(name: str, value: Any, owner: str = "RoundPipeStrategy") -> bool:
    """``value`` if it is a bool. No ``bool()`` coercion: ``"False"`` would become True.
    ``owner`` (here and below) names the class whose argument it is, in the message."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{owner}({name}={value!r}): {name} must be True or False (a bool), got "
            f"{type(value).__name__}; in YAML write true / false without quotes"
        )
    return value


def check_choice(
    name: str, value: Any, choices: tuple[Any, ...], owner: str = "RoundPipeStrategy"
) -> Any:
    """``value`` if it is one of ``choices`` (a clear TypeError / ValueError otherwise)."""
    kinds = {type(c) for c in choices if c is not None}
    if value is not None and not isinstance(value, tuple(kinds)):
        raise TypeError(
            f"{owner}({name}={value!r}): {name} must be one of {choices}, got "
            f"{type(value).__name__}"
        )
    if value not in choices:
        raise ValueError(f"{owner}({name}={value!r}): {name} must be one of {choices}")
    return value


def check_num_microbatch(value: Any, owner: str = "RoundPipeStrategy") -> int | None:
    """``value`` if it is None or an int >= 1."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f"{owner}(num_microbatch={value!r}): num_microbatch must be a positive int "
            f"or None, got {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"{owner}(num_microbatch={value!r}): num_microbatch must be >= 1 (or None "
            "for the engine's default: devices + 1 on GPUs, 1 or one per worker on CPU "
            "workers)"
        )
    return value


def check_type(
    name: str,
    value: Any,
    types: tuple[type, ...],
    accepted: str,
    owner: str = "RoundPipeStrategy",
) -> None:
    """A TypeError naming ``name`` unless ``value`` is None or one of ``types``."""
    if value is not None and not isinstance(value, types):
        raise TypeError(
            f"{owner}({name}=...): {name} must be None or {accepted}, got {type(value).__name__}"
        )


def check_plugins(checkpoint_io: Any, precision_plugin: Any) -> None:
    """TypeErrors for a ``checkpoint_io`` / ``precision_plugin`` of the wrong kind (they
    would fail only at the first save or at teardown, or be silently ignored)."""
    check_type("checkpoint_io", checkpoint_io, (CheckpointIO,), "a lightning CheckpointIO")
    if isinstance(precision_plugin, (str, int)):
        raise TypeError(
            f"RoundPipeStrategy(precision_plugin={precision_plugin!r}): pass the precision to "
            f"the Trainer instead: Trainer(precision={precision_plugin!r}, strategy=...)"
        )
    check_type("precision_plugin", precision_plugin, (Precision,), "a lightning Precision plugin")


def check_pool_devices(
    devices: list[torch.device], owner: str = "RoundPipeStrategy", entry: str = "Trainer"
) -> list[torch.device]:
    """``devices`` if they are all CPU workers or all CUDA GPUs; a single CPU worker
    gets a hint that nothing is pipelined and how to ask for more. ``entry`` is what
    takes ``devices`` (Trainer, Fabric)."""
    kinds = {d.type for d in devices}
    if not kinds <= {"cpu", "cuda"} or len(kinds) != 1:
        raise ValueError(
            f"{owner} runs on CPU workers or CUDA GPUs, got devices {devices}; "
            f"use {entry}(accelerator='cpu' or 'gpu', devices=N)"
        )
    if devices[0].type == "cpu" and len(devices) == 1:
        # devices="auto" on CPU is one device: training works but nothing overlaps
        log.warning(
            f"{owner} runs on 1 CPU worker (what {entry}(devices='auto') gives on "
            "CPU): one worker runs every stage in turn, so nothing is pipelined. Pass "
            f"{entry}(accelerator='cpu', devices=N) with N >= 2 for N workers (they share this "
            "machine's cores); RoundPipe used without Lightning takes devices=N or reads "
            "ROUNDPIPE_CPU_DEVICES."
        )
    return devices


# -- one process per node: the launch checks both strategies make ----------------------------
def crowded_node(local_rank: int, processes: int, num_nodes: int) -> str | None:
    """What shows that the launcher started more than one process on this node
    (``torchrun --nproc-per-node 2``, ``srun --ntasks-per-node 2``, ``LOCAL_RANK=1``, more
    processes than nodes), or None."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if local_world.isdigit() and int(local_world) > 1:
        return f"LOCAL_WORLD_SIZE={local_world}"
    if local_rank > 0:
        return f"LOCAL_RANK={local_rank}"
    if processes > num_nodes:
        return f"{processes} processes (WORLD_SIZE) for num_nodes={num_nodes}"
    return None


def crowded_node_error(owner: str, entry: str, devices: str, crowded: str) -> ValueError:
    """The refusal of several processes on one node (``crowded``, from :func:`crowded_node`):
    each would claim all the node's devices. ``entry`` is what the user builds (``Trainer``
    / ``Fabric``), ``devices`` the devices argument as the user wrote it."""
    return ValueError(
        f"{owner} runs one process per node, and that process drives all of the node's "
        f"devices ({entry}(devices={devices})); this process is one of several on its node "
        f"({crowded}), so each would claim the same devices. Launch one process per node: "
        "on one machine plain `python train.py` (no torchrun); on N machines `torchrun "
        f"--nnodes N --nproc-per-node 1 train.py` with {entry}(num_nodes=N), or `srun "
        "--ntasks-per-node=1`."
    )


def not_launched_error(owner: str, num_nodes: int) -> ValueError:
    """The refusal of ``num_nodes > 1`` in a process no launcher started."""
    return ValueError(
        f"{owner} with num_nodes={num_nodes} runs one process per node, started by a "
        "launcher: torchrun (--nnodes N --nproc-per-node 1), SLURM (srun, one task per node) "
        "or the MASTER_ADDR / MASTER_PORT / WORLD_SIZE / NODE_RANK / LOCAL_RANK=0 "
        "environment. This process was not started that way."
    )
