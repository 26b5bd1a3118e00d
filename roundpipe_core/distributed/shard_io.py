"""Checkpoints of a sharded host state: each rank writes its own shard
(``shard-RRRRR-of-NNNNN.pt``: by parameter name, the masters and optimizer state it owned,
and the hyperparameters), no process gathers the whole state, and names let the shards
load back on any rank count, one memory-mapped file at a time.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..checkpoint_file import CorruptCheckpointError, read_checkpoint

__all__ = ["SHARD_FORMAT", "load_shards", "merge_shards", "save_shard", "shard_files"]

#: Version of the shard layout; another version is refused, not guessed at.
SHARD_FORMAT = 1
_NAME = re.compile(r"shard-(\d{5})-of-(\d{5})\.pt$")


def _shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def save_shard(
    directory: str | Path,
    named_params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    owns: Callable[[torch.Tensor], bool],
    rank: int,
    world_size: int,
    edit_groups: Callable[[list[dict[str, Any]]], None] | None = None,
    learned: Any = None,
) -> Path:
    """Write this rank's shard into ``directory`` and return its path: what it ``owns``,
    the hyperparameters (after ``edit_groups``) and ``learned`` (``pool.learned_draws``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name_of = {id(p): n for n, p in named_params.items()}
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        hyper["param_names"] = [name_of[id(p)] for p in g["params"] if id(p) in name_of]
        groups.append(hyper)
    if edit_groups is not None:
        edit_groups(groups)
    masters: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for n, p in named_params.items():
        if not owns(p):
            continue
        masters[n] = p.detach()  # the live tensors: torch.save streams them, no copy
        if p in optimizer.state:
            state[n] = dict(optimizer.state[p])
    shard = {
        "format": SHARD_FORMAT,
        "rank": rank,
        "world_size": world_size,
        "param_groups": groups,
        "masters": masters,
        "state": state,
        "learned": learned,
    }
    path = directory / _shard_name(rank, world_size)
    tmp = path.with_suffix(".tmp")
    torch.save(shard, tmp)
    tmp.replace(path)  # a reader sees the old complete file or the new one
    return path


def shard_files(directory: str | Path) -> list[Path]:
    """The shard files of ``directory`` in rank order, checked to be one complete set.

    Raises:
        FileNotFoundError: no shards there.
        ValueError: files of different rank counts, or a rank's file missing.
    """
    directory = Path(directory)
    found: dict[int, tuple[int, Path]] = {}
    for f in sorted(directory.glob("shard-*-of-*.pt")):
        m = _NAME.search(f.name)
        if m:
            found[int(m.group(1))] = (int(m.group(2)), f)
    if not found:
        raise FileNotFoundError(f"no host-state shards (shard-*-of-*.pt) in {directory}")
    worlds = {w for w, _ in found.values()}
    if len(worlds) != 1:
        raise ValueError(f"{directory} mixes shards of rank counts {sorted(worlds)}; keep one set")
    world = worlds.pop()
    missing = sorted(set(range(world)) - set(found))
    if missing:
        raise ValueError(
            f"{directory}: the shard of rank {missing[0]} of {world} is missing "
            f"(expected {_shard_name(missing[0], world)})"
        )
    return [found[r][1] for r in range(world)]


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _read(path: Path, rank: int, world: int) -> dict[str, Any]:
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(path, why, rank=rank)

    try:  # (each storage checked against its CRC-32 first)
        shard = read_checkpoint(path, map_location="cpu", mmap=True, weights_only=True)
    except CorruptCheckpointError as exc:  # a truncated or damaged file: name the rank
        raise bad(exc.reason) from None
    except pickle.UnpicklingError as exc:  # a complete file, but not one save_shard wrote
        raise bad(
            f"it holds objects a shard never has ({type(exc).__name__} under weights_only)"
        ) from None
    if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT:
        raise bad(f"not a shard of format {SHARD_FORMAT}")
    if shard.get("rank") != rank or shard.get("world_size") != world:
        raise bad(f"it says rank {shard.get('rank')} of {shard.get('world_size')}")
    for key in ("param_groups", "masters", "state"):
        if key not in shard:
            raise bad(f"no {key!r}")
    return shard


def load_shards(
    directory: str | Path,
    named_params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    owns: Callable[[torch.Tensor], bool] = lambda p: True,
) -> Any:
    """Load the shards of ``directory`` (any rank count) into this rank: masters and
    optimizer state of the parameters it ``owns`` (default all), and the hyperparameters.
    Returns the first shard's ``learned`` (or ``None``).

    Raises:
        ValueError: a shard is unreadable or inconsistent (naming the rank that wrote
            it), or names do not match the optimizer's parameters.
    """
    files = shard_files(directory)
    world = len(files)
    seen: set[str] = set()
    learned = None
    for rank, path in enumerate(files):
        shard = _read(path, rank, world)
        unknown = sorted(set(shard["masters"]) - set(named_params))
        if unknown:
            raise ValueError(
                f"host-state shard of rank {rank} ({path}) holds parameters this model does not "
                f"have: {unknown[:3]}"
            )
        if rank == 0:  # the hyperparameters, the same in every shard
            saved_groups = shard["param_groups"]
            if len(saved_groups) != len(optimizer.param_groups):
                raise ValueError(
                    f"host-state shard of rank {rank}: {len(saved_groups)} param groups saved, "
                    f"the optimizer has {len(optimizer.param_groups)}"
                )
            for g, saved in zip(optimizer.param_groups, saved_groups):
                g.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
            learned = shard.get("learned")
        with torch.no_grad():
            for n, value in shard["masters"].items():
                seen.add(n)
                p = named_params[n]
                if not owns(p):
                    continue
                if value.shape != p.shape:
                    raise ValueError(
                        f"host-state shard of rank {rank}: {n} has shape {tuple(value.shape)}, "
                        f"the model {tuple(p.shape)}"
                    )
                p.copy_(value)
                st = shard["state"].get(n)
                if st is None:
                    optimizer.state.pop(p, None)
                else:  # copies: the mapped file is released when this loop moves on
                    optimizer.state[p] = _copied(st)
    missing = sorted(set(named_params) - seen)
    if missing:
        raise ValueError(f"no host-state shard in {directory} holds {missing[:3]}")
    return learned


def merge_shards(directory: str | Path) -> dict[str, Any]:
    """The whole state of a sharded checkpoint, in one process: ``{"masters": {name:
    tensor}, "optimizer": an ordinary optimizer state_dict}`` (state indexed by the
    parameters' positions in the param groups, as ``optimizer.load_state_dict`` takes
    it; the groups' ``param_names`` say which is which)."""
    files = shard_files(directory)
    masters: dict[str, torch.Tensor] = {}
    state_by_name: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for rank, path in enumerate(files):
        shard = _read(path, rank, len(files))
        masters.update({n: t.clone() for n, t in shard["masters"].items()})
        state_by_name.update({n: _copied(st) for n, st in shard["state"].items()})
        if not groups:
            groups = [dict(g) for g in shard["param_groups"]]
    state: dict[int, Any] = {}
    index = 0
    for g in groups:
        g["params"] = list(range(index, index + len(g["param_names"])))
        for i, n in zip(g["params"], g["param_names"]):
            if n in state_by_name:
                state[i] = state_by_name[n]
        index += len(g["param_names"])
    return {"masters": masters, "optimizer": {"state": state, "param_groups": groups}}
