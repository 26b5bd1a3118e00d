"""Process-group set-up and the small collectives of data-parallel RoundPipe: identities
without a process group; a failed collective (a peer died or stalled past the timeout)
raises :class:`CollectiveError` naming this rank, the backend's error chained.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "DistEnv",
    "resolve_timeout",
    "dist_env_from_environ",
    "init_process_group",
    "destroy_process_group",
    "all_reduce",
    "barrier",
    "broadcast_object",
    "all_gather",
    "CollectiveError",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""Process-group timeout when none is given (torch's own default)."""

TIMEOUT_ENV = "ROUNDPIPE_DIST_TIMEOUT"
"""Environment variable: the process-group timeout in seconds."""

_pg_timeout: timedelta | None = None  # what init_process_group() used; reducers' groups inherit it
# NCCL: this rank's GPU, named once at init_process_group. Every thread must use it: another
# device makes NCCL build a second communicator, which can hang a multi-node job.
_nccl_device: torch.device | None = None


def resolve_timeout(timeout: float | int | timedelta | None = None) -> timedelta:
    """The process-group timeout: ``timeout`` (seconds or ``timedelta``), else
    ``$ROUNDPIPE_DIST_TIMEOUT`` seconds, else 30 minutes.

    Raises:
        ValueError: a non-positive, infinite, NaN or unparsable timeout.
        TypeError: a timeout that is neither a number nor a ``timedelta``.
    """
    raw: str | None = None
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(
            f"timeout must be seconds (a number) or a datetime.timedelta, got {type(timeout).__name__}"
        )
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    # checked before building a timedelta, which overflows on inf and rejects nan unclearly
    if not (seconds > 0 and math.isfinite(seconds)):
        source = f"{TIMEOUT_ENV}={raw!r}" if raw is not None else f"timeout={timeout!r}"
        raise ValueError(
            f"{source} is not a positive, finite number of seconds; give e.g. 1800 (30 minutes)"
        )
    try:
        return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(
            f"timeout={timeout!r} seconds is too large for a datetime.timedelta; give at most "
            f"{int(timedelta.max.total_seconds())}"
        ) from None


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job: global ``rank``, ``world_size``, rank 0's
    rendezvous, and the launcher they came from ("torchrun", "slurm", "env")."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _slurm_root_address(nodelist: str) -> str:
    """First host of a SLURM node list: ``node[003-005,9],gpu1`` -> ``node003``."""
    m = re.match(r"([^,\[]*)(?:\[([^,\]-]*))?", nodelist.strip())
    assert m is not None  # (the pattern matches any string)
    return m.group(1) + (m.group(2) or "")


def dist_env_from_environ(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size and rendezvous from the environment a launcher sets, in this
    order: torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); SLURM
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_NODELIST``; port from ``MASTER_PORT`` or
    ``SLURM_JOB_ID``, as Lightning); a hand-written launch, one process per node
    (``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    Raises:
        ValueError: naming the variables that are missing or malformed.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        source, rank_var = "torchrun", "RANK"
    elif (
        "SLURM_PROCID" in env
        and "SLURM_NTASKS" in env
        and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    ):
        # (an interactive allocation's shell is not a launch, as in Lightning's SLURMEnvironment)
        if "SLURM_NODELIST" not in env and "MASTER_ADDR" not in env:
            raise ValueError(
                "SLURM launch without SLURM_NODELIST: set MASTER_ADDR to rank 0's host"
            )
        rank = _int_var(env, "SLURM_PROCID")
        world = _int_var(env, "SLURM_NTASKS")
        addr = env.get("MASTER_ADDR") or _slurm_root_address(env["SLURM_NODELIST"])
        if "MASTER_PORT" in env:
            port = _int_var(env, "MASTER_PORT")
        else:
            job = env.get("SLURM_JOB_ID", "0")
            port = 15000 + (int(job[-4:]) if job[-4:].isdigit() else 0)
        return _checked(DistEnv(rank, world, addr, port, "slurm"))
    elif "NODE_RANK" in env:
        source, rank_var = "env", "NODE_RANK"
    else:
        raise ValueError(
            "no distributed launch found in the environment: set RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT (torchrun does), run under SLURM (srun), or set NODE_RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT on every node (one process per node)"
        )
    missing = [v for v in (rank_var, "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env]
    if missing:
        raise ValueError(
            f"distributed launch ({source}) is missing environment variable(s) {', '.join(missing)}; "
            f"set all of {rank_var}, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    rank, world, port = (_int_var(env, v) for v in (rank_var, "WORLD_SIZE", "MASTER_PORT"))
    return _checked(DistEnv(rank, world, env["MASTER_ADDR"], port, source))


def _checked(e: DistEnv) -> DistEnv:
    if e.world_size < 1:
        raise ValueError(f"world size must be >= 1, got {e.world_size} (from {e.source})")
    if not 0 <= e.rank < e.world_size:
        raise ValueError(f"rank {e.rank} is outside 0..{e.world_size - 1} (from {e.source})")
    if not 0 < e.master_port < 65536:
        raise ValueError(f"MASTER_PORT must be a TCP port (1..65535), got {e.master_port}")
    return e


def init_process_group(
    cluster_environment: Any | None = None,
    backend: str = "gloo",
    timeout: float | int | timedelta | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> dist.ProcessGroup:
    """Create (or reuse) the default process group from a Lightning ``ClusterEnvironment``
    or the environment (:func:`dist_env_from_environ`); ``rank`` / ``world_size`` override
    them. ``backend``: "gloo" or "nccl"; ``timeout``: see :func:`resolve_timeout`.

    Raises:
        ValueError: a missing or inconsistent environment, or a group that already
            exists with another world size.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    td = resolve_timeout(timeout)
    if cluster_environment is not None:
        ce = cluster_environment
        env = DistEnv(
            int(ce.global_rank()),
            int(ce.world_size()),
            str(ce.main_address),
            int(ce.main_port),
            type(ce).__name__,
        )
    else:
        env = dist_env_from_environ()
    rank = env.rank if rank is None else rank
    world_size = env.world_size if world_size is None else world_size
    env = _checked(replace(env, rank=rank, world_size=world_size))
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise ValueError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launch says rank {env.rank} of {env.world_size}"
            )
        return _world_group()
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    global _pg_timeout, _nccl_device
    _pg_timeout = td
    extra: dict[str, Any] = {}
    if backend == "nccl":
        _nccl_device = _local_gpu(cluster_environment, env.rank)
        torch.cuda.set_device(_nccl_device)
        extra["device_id"] = _nccl_device  # bind the communicator to this rank's GPU
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=td,
        **extra,
    )
    return _world_group()


def _local_gpu(cluster_environment: Any | None, rank: int) -> torch.device:
    """This rank's GPU for NCCL: its local rank (else the global one) modulo the GPUs."""
    count = torch.cuda.device_count()
    if count < 1:
        raise ValueError("backend='nccl' needs a CUDA GPU on every rank; use backend='gloo'")
    local = None
    if cluster_environment is not None and hasattr(cluster_environment, "local_rank"):
        local = int(cluster_environment.local_rank())
    elif os.environ.get("LOCAL_RANK", "").strip().isdigit():
        local = int(os.environ["LOCAL_RANK"])
    return torch.device("cuda", (rank if local is None else local) % count)


def _world_group() -> dist.ProcessGroup:
    assert dist.group.WORLD is not None  # initialised just before
    return dist.group.WORLD


def destroy_process_group() -> None:
    """Tear down the default group if there is one (safe to call twice)."""
    global _nccl_device
    _nccl_device = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def group_size(group: Any | None = None) -> int:
    """World size of ``group`` (the default group if None); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def is_nccl(group: Any | None = None) -> bool:
    """Whether ``group`` runs on NCCL (it then reduces GPU tensors only)."""
    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):
        return False


def new_group(timeout: float | int | timedelta | None = None) -> Any:
    """A new gloo group of all ranks (collective), bounded by ``timeout``, else the timeout
    :func:`init_process_group` used, else :func:`resolve_timeout`'s default."""
    td = resolve_timeout(timeout) if timeout is not None or _pg_timeout is None else _pg_timeout
    return dist.new_group(backend="gloo", timeout=td)


def destroy_group(group: Any | None) -> None:
    """Free a group made by :func:`new_group` (``None``: nothing to free)."""
    if group is not None:
        # (the default group may already be gone: teardown order)
        with suppress(RuntimeError, ValueError, AssertionError):
            dist.destroy_process_group(group)


def comm_device(group: Any | None = None) -> torch.device:
    """Where ``group`` reduces tensors: the host for gloo; for NCCL the GPU
    :func:`init_process_group` bound (else the current device)."""
    if is_nccl(group):
        if _nccl_device is not None:
            return _nccl_device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CollectiveError(RuntimeError):
    """A collective failed on this rank (a peer died, stalled or called another one)."""


def collective_error(what: str, exc: BaseException, group: Any | None = None) -> CollectiveError:
    """The error for ``exc`` from the collective ``what``, naming this rank and the likely
    cause, so a dead peer reads the same wherever it is first noticed."""
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError):
        rank, world = -1, -1  # the group itself is gone
    where = f"rank {rank} of {world}" if rank >= 0 else "this rank (its process group is gone)"
    return CollectiveError(
        f"{what} failed on {where}: a peer process may have died or stalled (collectives are "
        f"bounded by the process-group timeout; set it with timeout= / process_group_timeout= / "
        f"{TIMEOUT_ENV}): {exc}"
    )


@contextmanager
def collective(what: str, group: Any | None = None) -> Iterator[None]:
    """Raise :func:`collective_error` for a ``RuntimeError`` of the collective ``what``."""
    try:
        yield
    except RuntimeError as exc:
        raise collective_error(what, exc, group) from exc


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def all_reduce(tensor: torch.Tensor, op: str = "mean", group: Any | None = None) -> torch.Tensor:
    """The reduction of ``tensor`` over ``group`` by ``op`` ("mean", "sum", "max", "min" or
    "product"; "mean" of integers is a float tensor), as a new tensor on its device.

    Raises:
        CollectiveError: the collective failed (a peer died or stalled).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce takes a tensor, got {type(tensor).__name__}")
    if op not in _REDUCE_OPS and op != "mean":
        raise ValueError(
            f"op must be one of 'mean', {', '.join(repr(k) for k in _REDUCE_OPS)}; got {op!r}"
        )
    out = tensor.detach().clone()
    if op == "mean" and not out.is_floating_point():
        out = out.to(torch.get_default_dtype())
    if group_size(group) == 1:
        return out
    comm = out.to(comm_device(group))  # gloo reduces host tensors, NCCL GPU tensors
    with collective(f"all_reduce({op})", group):
        dist.all_reduce(comm, op=_REDUCE_OPS.get(op, dist.ReduceOp.SUM), group=group)
    if op == "mean":
        comm.div_(dist.get_world_size(group))
    return comm.to(tensor.device)


def barrier(group: Any | None = None, timeout: float | int | timedelta | None = None) -> None:
    """Wait for every rank. On gloo this is ``monitored_barrier``: a rank that does not
    arrive within ``timeout`` (default: the environment's / 30 min) is named in the error.

    Raises:
        CollectiveError: a rank did not arrive in time or the group is broken.
    """
    if group_size(group) == 1:
        return
    with collective("barrier", group):
        if is_nccl(group):
            # on the communicator's GPU: without device_ids NCCL guesses cuda:(rank % n)
            dist.barrier(group=group, device_ids=[comm_device(group).index])
        else:
            dist.monitored_barrier(
                group=group, timeout=resolve_timeout(timeout), wait_all_ranks=True
            )


def broadcast_object(obj: Any, src: int = 0, group: Any | None = None) -> Any:
    """Rank ``src``'s ``obj`` (any picklable object) on every rank.

    Raises:
        CollectiveError: the collective failed (a peer died or stalled).
    """
    if group_size(group) == 1:
        return obj
    box = [obj]
    with collective(f"broadcast_object(src={src})", group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather(tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension; sizes may differ
    between ranks (not dims or dtype): they are zero-padded to the largest.

    Raises:
        CollectiveError: the collective failed (a peer died or stalled).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_gather takes a tensor, got {type(tensor).__name__}")
    t = tensor.detach()
    world = group_size(group)
    if world == 1:
        return t.clone().unsqueeze(0)
    dev = comm_device(group)
    with collective("all_gather", group):
        shape = torch.tensor(list(t.shape), dtype=torch.long, device=dev)
        shapes = [torch.empty_like(shape) for _ in range(world)]
        dist.all_gather(shapes, shape, group=group)
        biggest = torch.stack(shapes).max(0).values.tolist() if t.dim() else []
        padded = torch.zeros(biggest, dtype=t.dtype, device=dev)
        padded[tuple(slice(0, n) for n in t.shape)] = t.to(dev)
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
    return torch.stack(parts).to(tensor.device)
