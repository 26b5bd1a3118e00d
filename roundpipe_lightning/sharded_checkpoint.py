"""Lightning checkpoints of ``RoundPipeStrategy(shard_host_state=True)``.

Each rank owns the optimizer state of its share of the parameters, so no rank can
write the whole checkpoint without gathering the others' state. Instead:

* rank 0 writes the Lightning checkpoint file as always (the weights -- every rank
  holds them all --, loops, callbacks, the RoundPipe section), with a small marker in
  place of each sharded optimizer's state;
* every rank writes its share of that optimizer's state next to it, into
  ``<checkpoint>.shards/optimizer<i>/shard-RRRRR-of-NNNNN.pt``
  (:func:`roundpipe_core.distributed.save_shard`). Several nodes need a file system
  they all see, as for any multi-node resume.

``RoundPipeFabricStrategy(shard_host_state=True)`` does the same for ``fabric.save``:
the optimizer saved under the state key ``KEY`` leaves a marker in the file and its
shards in ``<checkpoint>.shards/KEY/`` (:func:`fabric_shards_dir`); ``fabric.load``
reads them back on any node count.

Resuming (``Trainer.fit(ckpt_path=...)``) reads the shards of any rank count, each rank
keeping the entries it owns now -- sharded or not, on 1, 2, 4 ... ranks.
:func:`convert_sharded_checkpoint` turns such a checkpoint into an ordinary one (the
optimizer states merged, in one process) that plain Lightning loads.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

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
    """Where the shards of optimizer ``index`` of the checkpoint ``checkpoint_path`` live."""
    return Path(f"{checkpoint_path}.shards") / f"optimizer{index}"


def fabric_shards_dir(checkpoint_path: str | Path, key: str) -> Path:
    """Where the shards of the optimizer a ``fabric.save`` state holds under ``key`` live.

    Raises:
        ValueError: ``key`` cannot name a directory (empty, ``.``/``..`` or a path separator).
    """
    if not isinstance(key, str) or key in ("", ".", "..") or "/" in key or "\\" in key:
        raise ValueError(
            f"fabric.save(): a sharded optimizer's state key names the directory of its shards "
            f"(<checkpoint>.shards/KEY/); {key!r} cannot, use a plain name such as 'optimizer'"
        )
    return Path(f"{checkpoint_path}.shards") / key


def remove_shards(checkpoint_path: str | Path) -> None:
    """Delete ``<checkpoint_path>.shards/`` (all optimizers' shards), if there is one."""
    directory = Path(f"{checkpoint_path}.shards")
    if directory.is_dir():
        shutil.rmtree(directory)


def marker(world_size: int) -> dict[str, Any]:
    """What a checkpoint's ``optimizer_states`` holds for a sharded optimizer."""
    return {SHARDS_KEY: {"format": SHARD_FORMAT, "world_size": world_size}}


def is_marker(state: Any) -> bool:
    return isinstance(state, Mapping) and SHARDS_KEY in state


def of_optimizer(
    named_masters: Mapping[str, torch.Tensor], optimizer: Any
) -> dict[str, torch.Tensor]:
    """The entries of ``named_masters`` that ``optimizer`` steps: its shards hold those
    only (with several optimizers, the others' are in their own shards)."""
    raw = getattr(optimizer, "_optimizer", optimizer)
    ids = {id(p) for g in raw.param_groups for p in g["params"]}
    return {n: p for n, p in named_masters.items() if id(p) in ids}


def sharded_masters(dp: D.DataParallel, optimizers: Sequence[Any]) -> set[int]:
    """Ids of the masters a sharded checkpoint keeps in its shards, each in its owner's
    (not in the checkpoint file: rank 0 may hold the values of its own share only; loading
    broadcasts each owner's into every rank's model)."""
    return {id(p) for opt in optimizers if (s := dp.shard(opt)) is not None for p in s.params}


def load_optimizer_state(
    directory: Path | None,
    optimizer: Any,
    state: Any,
    shard: D.HostShard | None,
    named_masters: Mapping[str, torch.Tensor],
) -> None:
    """Restore one optimizer from ``state``: an ordinary state dict, or a marker whose
    shards are in ``directory`` (written on any rank count). Sharded (``shard``), this
    rank keeps only the state of the parameters it owns. From shards the masters of
    those parameters are restored too (a separate fp32 master exactly, which the file's
    half-precision weights cannot give; a shared one is its weight: the same value), and
    broadcast into the other ranks' model weights (collective: every rank loads the same
    optimizers)."""
    raw = getattr(optimizer, "_optimizer", optimizer)
    if is_marker(state):
        if directory is None:
            raise ValueError(
                "this checkpoint's optimizer state is sharded across ranks "
                "(<checkpoint>.shards/); load it through Trainer(ckpt_path=...), or "
                "merge it first with roundpipe_lightning.convert_sharded_checkpoint(path, out)"
            )
        owns = shard.owns if shard is not None else (lambda p: True)
        D.load_shards(directory, of_optimizer(named_masters, raw), raw, owns)
        if shard is not None:
            # (collective) each owner's exact masters into the others' copies: their
            # model weights (a separate master) or the master itself (a shared one)
            shard.gather()
    else:
        raw.load_state_dict(state)
    if shard is not None:
        shard.drop_foreign_state(raw)


def _put_back_masters(ckpt: dict[str, Any], masters: Mapping[str, torch.Tensor]) -> None:
    """The shards' masters whose dtype differs from the saved weight's, into the
    checkpoint's RoundPipe section (where an unsharded run keeps them)."""
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
    """Write an ordinary Lightning checkpoint from a sharded one: the optimizer states
    merged from ``<checkpoint_path>.shards/``, and the masters the shards hold that are
    of another dtype than their weights (the fp32 masters of a bf16 module) put back
    into the RoundPipe section, as an unsharded run writes them; everything else as
    saved. The result loads with any strategy (``Trainer(ckpt_path=out_path)``) and
    ``LightningModule.load_from_checkpoint``. Needs the memory of the whole state, in
    this one process. Returns ``out_path``.

    Raises:
        ValueError: a shard is missing or unreadable (naming the rank that wrote it);
            :class:`~roundpipe_core.checkpoint_file.CorruptCheckpointError` for a damaged
            checkpoint file or shard.
    """
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
