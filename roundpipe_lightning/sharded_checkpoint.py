"""Checkpoints of ``shard_host_state=True``: rank 0's file holds a marker in place of each
sharded optimizer's state, every rank writes its share into ``<checkpoint>.shards/``
(layout, resume on any rank count, merging: docs/multi-node.md).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from roundpipe_core import distributed as D
from roundpipe_core.checkpoint_file import read_checkpoint
from roundpipe_core.distributed.shard_io import SHARD_FORMAT

from .checkpoint_io import CHECKPOINT_KEY

__all__ = [
    "SHARDS_KEY",
    "convert_sharded_checkpoint",
    "fabric_shards_dir",
    "remove_shards",
    "shards_dir",
]

#: Key of the marker that stands for a sharded optimizer state in ``optimizer_states``.
SHARDS_KEY = "roundpipe_host_shards"


def shards_dir(checkpoint_path: str | Path, index: int) -> Path:
    """Where the shards of optimizer ``index`` of ``checkpoint_path`` live."""
    return Path(f"{checkpoint_path}.shards") / f"optimizer{index}"


def fabric_shards_dir(checkpoint_path: str | Path, key: str) -> Path:
    """Where the shards of the optimizer ``fabric.save`` holds under ``key`` live (a
    ValueError for a key that cannot name a directory)."""
    if not isinstance(key, str) or key in ("", ".", "..") or "/" in key or "\\" in key:
        raise ValueError(
            f"fabric.save(): a sharded optimizer's state key names the directory of its shards "
            f"(<checkpoint>.shards/KEY/); {key!r} cannot, use a plain name such as 'optimizer'"
        )
    return Path(f"{checkpoint_path}.shards") / key


def remove_shards(checkpoint_path: str | Path) -> None:
    """Delete ``<checkpoint_path>.shards/``, if there is one."""
    directory = Path(f"{checkpoint_path}.shards")
    if directory.is_dir():
        shutil.rmtree(directory)


def marker(world_size: int) -> dict[str, Any]:
    """What a checkpoint's ``optimizer_states`` holds for a sharded optimizer."""
    return {SHARDS_KEY: {"format": SHARD_FORMAT, "world_size": world_size}}


def is_marker(state: Any) -> bool:
    return isinstance(state, Mapping) and SHARDS_KEY in state


def of_optimizer(
    named_masters: Mapping[str, torch.Tensor], optimizer: Optimizer
) -> dict[str, torch.Tensor]:
    """The entries of ``named_masters`` that ``optimizer`` steps (what its shards hold)."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return {n: p for n, p in named_masters.items() if id(p) in ids}


def sharded_masters(dp: D.DataParallel, optimizers: Sequence[Any]) -> set[int]:
    """Ids of the masters kept in shards, not in the file (rank 0 may hold only its own
    share's values; loading broadcasts each owner's)."""
    return {id(p) for opt in optimizers if (s := dp.shard(opt)) is not None for p in s.params}


def load_optimizer_state(
    directory: Path | None,
    optimizer: Optimizer,
    state: Any,
    shard: D.HostShard | None,
    named_masters: Mapping[str, torch.Tensor],
) -> None:
    """Restore ``optimizer`` from a state dict or a marker of the shards in ``directory``
    (any rank count; sharded, this rank keeps what it owns). From shards the masters are
    restored exactly too, and broadcast into the other ranks' weights (collective)."""
    if is_marker(state):
        if directory is None:
            raise ValueError(
                "this checkpoint's optimizer state is sharded across ranks "
                "(<checkpoint>.shards/); load it through Trainer(ckpt_path=...), or merge it "
                "first with roundpipe_lightning.sharded_checkpoint.convert_sharded_checkpoint"
                "(path, out)"
            )
        owns = shard.owns if shard is not None else (lambda p: True)
        D.load_shards(directory, of_optimizer(named_masters, optimizer), optimizer, owns)
        if shard is not None:
            # (collective) each owner's exact masters into the others' copies: their
            # model weights (a separate master) or the master itself (a shared one)
            shard.gather()
    else:
        optimizer.load_state_dict(state)
    if shard is not None:
        shard.drop_foreign_state(optimizer)


def _put_back_masters(ckpt: dict[str, Any], masters: Mapping[str, torch.Tensor]) -> None:
    """The shards' masters whose dtype differs from the weight's, into the section."""
    section = ckpt.get(CHECKPOINT_KEY)
    weights = ckpt.get("state_dict", {})
    if not isinstance(section, dict):
        return
    held = section.setdefault("masters", {})
    for name, master in masters.items():
        weight = weights.get(name)
        if isinstance(weight, torch.Tensor) and weight.dtype != master.dtype:
            held.setdefault(name, master)


def convert_sharded_checkpoint(checkpoint_path: str | Path, out_path: str | Path) -> Path:
    """Write at ``out_path`` (returned) an ordinary Lightning checkpoint of a sharded one,
    as an unsharded run writes it: the optimizer states merged from the shards, their
    masters of another dtype than the weights in the RoundPipe section. It loads with
    any strategy; this process needs the memory of the whole state. A missing or
    damaged shard is a ``ValueError`` naming the rank that wrote it."""
    ckpt = read_checkpoint(checkpoint_path, map_location="cpu", weights_only=False, mmap=True)
    states = ckpt.get("optimizer_states", [])
    for i, state in enumerate(states):
        if is_marker(state):
            merged = D.merge_shards(shards_dir(checkpoint_path, i))
            for g in merged["optimizer"]["param_groups"]:
                g.pop("param_names", None)  # as an unsharded run's state_dict() has them
            states[i] = merged["optimizer"]
            _put_back_masters(ckpt, merged["masters"])
    out = Path(out_path)
    torch.save(ckpt, out)
    return out
