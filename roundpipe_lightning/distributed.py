"""Data parallel RoundPipe across processes and nodes over ``torch.distributed``.

RoundPipe drives every GPU of a node from one process; beyond one node (or, for
tests, several processes on one machine) each process holds a full RoundPipe
and the processes are data parallel: each trains on its own shard of the data
and the master gradients are all-reduced before every optimizer step.

The master gradients live on the host (fp32 ``.grad`` of
``rp.optim_parameters()``), so the natural backend is **gloo** over CPU
tensors. NCCL only reduces GPU tensors: with an NCCL group the reducer stages
each bucket through ``comm_device`` (a GPU) and back, which pays two PCIe copies
per bucket and only wins on fast inter-node fabrics; gloo is the default.

What is here (no Lightning import; the strategy wires it into Lightning):

* :class:`GradientAllReducer` -- bucketed all-reduce of the master gradients,
  optionally overlapped with the backward pass through RoundPipe's grad hook.
* :func:`sync_gradients` -- the one-shot, non-overlapped form.
* :class:`DataParallel` -- the whole interface a training loop (the Lightning
  strategy) needs: ``connect``, ``attach``, ``wrap_closure``, ``reduce``,
  ``abort``, ``detach``.
* :func:`broadcast_masters` -- make every rank start from rank ``src``'s weights.
* :func:`init_process_group` / :func:`dist_env_from_environ` -- process-group
  set-up from a Lightning ``ClusterEnvironment`` or from the environment that
  torchrun, SLURM or a hand-written launch (``MASTER_ADDR``, ``MASTER_PORT``,
  ``WORLD_SIZE``, ``NODE_RANK``) provide, with a configurable timeout.
* :func:`all_reduce`, :func:`barrier`, :func:`broadcast_object`,
  :func:`all_gather` -- small collectives over the same group.

Data: each process must see a different shard -- Lightning's
``DistributedSampler`` with ``num_replicas=world_size`` (one process per node)
and ``rank=global_rank``; in plain PyTorch pass the same to
``torch.utils.data.DistributedSampler`` and call ``set_epoch`` every epoch.

Failure: every collective is bounded by the process group's timeout
(``timeout=`` here, ``ROUNDPIPE_DIST_TIMEOUT`` seconds in the environment,
default 30 minutes like torch). A peer that dies closes its sockets and the
others fail at their next collective; a peer that stalls makes them fail when
the timeout expires. Either way the error is raised on the calling thread
(``finish()``), never a silent hang.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""Process-group timeout when none is given (torch's own default)."""

TIMEOUT_ENV = "ROUNDPIPE_DIST_TIMEOUT"
"""Environment variable: the process-group timeout in seconds."""

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce (as DDP's ``bucket_cap_mb=25``)."""

_OPS = ("mean", "sum")
_pg_timeout: timedelta | None = None  # what init_process_group() used; reducers' groups inherit it
_POLL_S = 0.05  # how often waiting threads look for an abort


# ---------------------------------------------------------------------------------------------
# process-group set-up
# ---------------------------------------------------------------------------------------------
def resolve_timeout(timeout: float | int | timedelta | None = None) -> timedelta:
    """The process-group timeout: ``timeout`` (seconds or ``timedelta``), else
    ``$ROUNDPIPE_DIST_TIMEOUT`` seconds, else 30 minutes.

    Raises:
        ValueError: a non-positive or unparsable timeout.
    """
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
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if not td.total_seconds() > 0 or math.isinf(td.total_seconds()):
        raise ValueError(f"timeout must be a positive, finite duration, got {timeout!r}")
    return td


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as read from the environment.

    Attributes:
        rank: global rank of this process (its node's rank with one process per node).
        world_size: number of processes.
        master_addr / master_port: the rendezvous of rank 0.
        source: which launcher the values came from ("torchrun", "slurm", "env").
    """

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
    depth, first = 0, ""
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += ch == "["
        depth -= ch == "]"
        first += ch
    if "[" not in first:
        return first
    prefix, rest = first.split("[", 1)
    return prefix + rest.rstrip("]").split(",")[0].split("-")[0]


def dist_env_from_environ(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size and rendezvous from the environment a launcher sets.

    Recognised, in this order:

    * torchrun / torchelastic: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
    * SLURM (``srun``, one task per node): ``SLURM_PROCID``, ``SLURM_NTASKS``,
      ``SLURM_NODELIST`` (rank 0's host); port from ``MASTER_PORT`` or derived from
      ``SLURM_JOB_ID`` (as Lightning does).
    * a hand-written launch, one process per node: ``NODE_RANK``, ``WORLD_SIZE`` (number
      of nodes), ``MASTER_ADDR``, ``MASTER_PORT``.

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
            "set all of "
            f"{rank_var}, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    return _checked(
        DistEnv(
            _int_var(env, rank_var),
            _int_var(env, "WORLD_SIZE"),
            env["MASTER_ADDR"],
            _int_var(env, "MASTER_PORT"),
            source,
        )
    )


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
    """Create (or reuse) the default process group for data-parallel RoundPipe.

    Args:
        cluster_environment: a Lightning ``ClusterEnvironment`` (the strategy's; its
            ``main_address``, ``main_port``, ``global_rank()``, ``world_size()`` are used).
            ``None``: read the environment (:func:`dist_env_from_environ`).
        backend: "gloo" (host gradients; the default) or "nccl".
        timeout: bound on every collective (seconds or ``timedelta``; see :func:`resolve_timeout`).
        rank / world_size: override the environment's values.

    Returns:
        The default process group (``torch.distributed.group.WORLD``).

    Raises:
        ValueError: a missing or inconsistent environment, or a group that already
            exists with another world size.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    td = resolve_timeout(timeout)
    if cluster_environment is not None:
        addr, port = cluster_environment.main_address, int(cluster_environment.main_port)
        r = cluster_environment.global_rank() if rank is None else rank
        w = cluster_environment.world_size() if world_size is None else world_size
        env = _checked(DistEnv(int(r), int(w), str(addr), port, type(cluster_environment).__name__))
    else:
        env = dist_env_from_environ()
        env = _checked(
            DistEnv(
                env.rank if rank is None else rank,
                env.world_size if world_size is None else world_size,
                env.master_addr,
                env.master_port,
                env.source,
            )
        )
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise ValueError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launch says rank {env.rank} of {env.world_size}"
            )
        return dist.group.WORLD
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    global _pg_timeout
    _pg_timeout = td
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=td,
    )
    return dist.group.WORLD


def destroy_process_group() -> None:
    """Tear down the default group if there is one (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _world(group: Any | None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _is_nccl(group: Any | None) -> bool:
    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# small collectives (identities without a process group)
# ---------------------------------------------------------------------------------------------
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def all_reduce(tensor: torch.Tensor, op: str = "mean", group: Any | None = None) -> torch.Tensor:
    """The reduction of ``tensor`` over the group, as a new tensor on ``tensor``'s device.

    Args:
        op: "mean", "sum", "max", "min" or "product". "mean" of an integer tensor
            gives a float tensor.
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
    if _world(group) == 1:
        return out
    comm = out.to(_comm_device(group))  # gloo reduces host tensors, NCCL GPU tensors
    dist.all_reduce(comm, op=_REDUCE_OPS.get(op, dist.ReduceOp.SUM), group=group)
    if op == "mean":
        comm.div_(dist.get_world_size(group))
    return comm.to(tensor.device)


def barrier(group: Any | None = None, timeout: float | int | timedelta | None = None) -> None:
    """Wait for every rank. On gloo this is ``monitored_barrier``: a rank that does not
    arrive within ``timeout`` (default: the environment's / 30 min) is named in the error."""
    if _world(group) == 1:
        return
    if _is_nccl(group):
        dist.barrier(group=group)
    else:
        dist.monitored_barrier(group=group, timeout=resolve_timeout(timeout), wait_all_ranks=True)


def broadcast_object(obj: Any, src: int = 0, group: Any | None = None) -> Any:
    """Rank ``src``'s ``obj`` (any picklable object) on every rank."""
    if _world(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather(tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension (``[world, *shape]``).

    Ranks may pass tensors whose sizes differ (not their number of dimensions or
    dtype): they are padded with zeros to the largest size along each dimension.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_gather takes a tensor, got {type(tensor).__name__}")
    t = tensor.detach()
    world = _world(group)
    if world == 1:
        return t.clone().unsqueeze(0)
    dev = _comm_device(group)
    shape = torch.tensor(list(t.shape), dtype=torch.long, device=dev)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    biggest = torch.stack(shapes).max(0).values.tolist() if t.dim() else []
    padded = torch.zeros(biggest, dtype=t.dtype, device=dev)
    padded[tuple(slice(0, n) for n in t.shape)] = t.to(dev)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.stack(parts).to(tensor.device)


def _comm_device(group: Any | None) -> torch.device:
    if _is_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------
def _broadcast_tensors(
    tensors: Sequence[torch.Tensor], src: int, group: Any | None, bucket_bytes: int
) -> None:
    """Broadcast tensors in place, flattened into per-dtype buckets."""
    dev = _comm_device(group)
    for bucket in _bucketize(list(tensors), bucket_bytes):
        flat = torch.cat([t.detach().reshape(-1).to(dev) for t in bucket])
        dist.broadcast(flat, src=src, group=group)
        off = 0
        with torch.no_grad():
            for t in bucket:
                n = t.numel()
                t.copy_(flat[off : off + n].view_as(t))
                off += n


def broadcast_masters(
    rp: Any, src: int = 0, group: Any | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Make every rank hold rank ``src``'s weights: the fp32 master parameters, the
    frozen parameters and the buffers (BatchNorm statistics) of ``rp.model``; then
    copy the masters into the model's own parameters.

    Call it once after building the RoundPipe (and after loading a checkpoint on one
    rank only), before the first step. Collective: every rank must call it.
    """
    if _world(group) == 1:
        return
    rp.synchronize()  # no step in flight writes the masters while we overwrite them
    tensors: list[torch.Tensor] = list(rp.optim_parameters())
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
    for p in rp.model.parameters():
        m = rp.master_param(p)
        if m is None:
            tensors.append(p)
        else:
            pairs.append((p, m))
    tensors.extend(
        b for b in rp.model.buffers() if b.is_floating_point() or b.dtype in (torch.long, torch.int)
    )
    _broadcast_tensors(tensors, src, group, bucket_bytes)
    with torch.no_grad():
        for p, m in pairs:
            p.copy_(m)


def params_in_sync(rp: Any, group: Any | None = None) -> bool:
    """True when every rank holds bit-identical master parameters (a debugging aid:
    one all-gather of a checksum per parameter). Collective."""
    if _world(group) == 1:
        return True
    sums = (
        torch.stack(
            [
                torch.stack(
                    [
                        m.detach().double().sum(),
                        m.detach().double().abs().sum(),
                        (
                            m.detach().double().reshape(-1)
                            * torch.arange(1, m.numel() + 1, dtype=torch.float64)
                        ).sum(),
                    ]
                )
                for m in rp.optim_parameters()
            ]
        )
        if rp.optim_parameters()
        else torch.zeros(1, 3, dtype=torch.float64)
    )
    everyone = all_gather(sums, group)
    return bool((everyone == everyone[0:1]).all())


# ---------------------------------------------------------------------------------------------
# gradient all-reduce
# ---------------------------------------------------------------------------------------------
def _bucketize(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``params`` of one dtype, each up to ``bucket_bytes``
    (a single larger tensor gets a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets and buckets[-1][0].dtype == p.dtype and size + nbytes <= bucket_bytes:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


class _Bucket:
    """Masters reduced together, and the flat host buffer they travel in: every
    gradient, then one "has a gradient" count per master (so a master without a
    gradient on every rank keeps ``grad=None``, as it would in one process)."""

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.dtype = params[0].dtype
        self.numel = sum(p.numel() for p in params)
        self.buffer: torch.Tensor | None = None

    def flatten(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.numel + len(self.params), dtype=self.dtype)
        buf, off = self.buffer, 0
        for p in self.params:
            n = p.numel()
            g = p.grad
            if g is None:
                buf[off : off + n].zero_()
            else:
                if g.is_sparse:
                    raise TypeError("sparse gradients cannot be all-reduced by GradientAllReducer")
                buf[off : off + n].copy_(g.reshape(-1))
            off += n
        buf[self.numel :] = torch.tensor(
            [p.grad is not None for p in self.params], dtype=self.dtype
        )
        return buf

    def unflatten(self, buf: torch.Tensor, divisor: int) -> None:
        if divisor != 1:
            buf[: self.numel].div_(divisor)
        off = 0
        had_grad = (buf[self.numel :] > 0).tolist()  # per param: some rank had a gradient
        with torch.no_grad():
            for i, p in enumerate(self.params):
                n = p.numel()
                if had_grad[i]:
                    part = buf[off : off + n].view_as(p)
                    if p.grad is None:
                        p.grad = part.clone()
                    else:
                        p.grad.copy_(part)
                off += n


class _Round:
    """One reduction: readiness of each bucket, the worker thread, the first error."""

    def __init__(self, buckets: list[_Bucket]) -> None:
        self.remaining = [len(b.params) for b in buckets]
        self.ready = [threading.Event() for _ in buckets]
        self.fired: set[int] = set()
        self.aborted = threading.Event()
        self.error: BaseException | None = None
        self.misuse: RuntimeError | None = None
        self.thread: threading.Thread | None = None
        self.issue_times: list[float] = []

    def set_all_ready(self) -> None:
        for e in self.ready:
            e.set()


class GradientAllReducer:
    """All-reduce RoundPipe's master gradients over a process group.

    Buckets hold the masters in *reverse* parameter order (the deepest layers'
    gradients are complete first) and are always all-reduced in that fixed order,
    from one thread per round, so every rank issues the same collectives in the same
    order whatever order the grad hooks fire in on each rank.

    Usage (one optimizer step, ``k`` accumulation micro-steps)::

        reducer = GradientAllReducer(rp, op="mean")
        for i, (x, y) in enumerate(micro_batches):
            if i == k - 1:
                reducer.arm()          # overlap the reduction with this last backward
            rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        reducer.finish()               # all reduced; .grad holds the mean over ranks
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=...)

    Without ``arm()`` (or with ``overlap=False``), ``finish()`` reduces everything
    then and there. ``finish()`` may follow any number of pipelined calls; it treats
    every gradient as complete when it is called.

    Args:
        rp: the ``RoundPipe`` whose ``optim_parameters()`` gradients are reduced.
        process_group: the group to reduce over. Default: a new gloo group of all ranks,
            owned by this reducer, so that collectives the training loop issues on the
            default group while a round is armed (``self.log(..., sync_dist=True)``,
            barriers) cannot interleave with the reducer thread's -- two threads issuing
            collectives on one group would order them differently on different ranks.
            Creating it is collective: every rank constructs its reducers in the same order.
            Pass a group only if nothing else uses it while a round is armed. With world
            size 1 (or no process group) the reducer does nothing.
        op: "mean" (divide the sum by the world size, as DDP) or "sum".
        bucket_bytes: gradient bytes per collective.
        overlap: register a grad hook so an armed round starts reducing a bucket as
            soon as its gradients are complete.
        params: the tensors whose ``.grad`` is reduced (default: all of
            ``rp.optim_parameters()``). An optimizer's parameters (e.g. one reducer per
            optimizer), which may include tensors outside RoundPipe that get their
            gradients through ordinary autograd: those are reduced too, only never early.
        timeout: bound on every collective of the reducer's own group (default: the
            timeout :func:`init_process_group` used, else ``$ROUNDPIPE_DIST_TIMEOUT``, else
            30 minutes). With an explicit ``process_group``: a bound on waiting for each
            all-reduce (default: that group's own timeout).
    """

    def __init__(
        self,
        rp: Any,
        process_group: Any | None = None,
        op: str = "mean",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        timeout: float | int | timedelta | None = None,
        params: Iterable[torch.Tensor] | None = None,
    ) -> None:
        if op not in _OPS:
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if not hasattr(rp, "optim_parameters") or not hasattr(rp, "register_grad_hook"):
            raise TypeError(f"GradientAllReducer needs a RoundPipe, got {type(rp).__name__}")
        self.rp = rp
        self.op = op
        self.overlap = bool(overlap)
        self._owns_group = process_group is None and _world(None) > 1
        if self._owns_group:
            td = (
                resolve_timeout(timeout)
                if timeout is not None or _pg_timeout is None
                else _pg_timeout
            )
            process_group = dist.new_group(backend="gloo", timeout=td)
            self.timeout = None  # the group's own timeout bounds every collective
        else:
            self.timeout = None if timeout is None else resolve_timeout(timeout)
        self.group = process_group
        # fixed at construction: a reducer built before the process group stays a no-op
        self._world_size = _world(process_group)
        chosen = _unique_params(rp.optim_parameters() if params is None else params)
        params = list(reversed(chosen))
        self.buckets = [_Bucket(i, b) for i, b in enumerate(_bucketize(params, bucket_bytes))]
        self._slot = {id(p): b.index for b in self.buckets for p in b.params}
        self._lock = threading.Lock()
        self._round: _Round | None = None
        self._remove_hook = rp.register_grad_hook(self._on_grads_ready) if self.overlap else None
        self._closed = False
        self.last_finish_wait_s = 0.0
        """Seconds the last ``finish()`` blocked the caller (the exposed communication)."""
        self.last_reduce_s = 0.0
        """Seconds from the last round's first collective to its last result."""

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def armed(self) -> bool:
        return self._round is not None

    # -- overlap ------------------------------------------------------------------------------
    def arm(self) -> None:
        """Start a round now: buckets are reduced as the grad hook reports them complete.

        Call it right before the *last* gradient-producing pipelined call of the
        optimizer step (the last ``forward_backward`` / ``loss.backward()`` of the
        accumulation window). A no-op with ``overlap=False`` or world size 1.

        Raises:
            RuntimeError: a round is already armed (call ``finish()`` first).
        """
        self._check_open()
        if self._round is not None:
            raise RuntimeError(
                "GradientAllReducer.arm() called twice; call finish() after each arm()"
            )
        if not self.overlap or self.world_size == 1:
            return
        rnd = _Round(self.buckets)
        rnd.thread = threading.Thread(
            target=self._reduce, args=(rnd,), daemon=True, name="roundpipe-allreduce"
        )
        with self._lock:
            self._round = rnd
        rnd.thread.start()

    def _on_grads_ready(self, masters: list[nn.Parameter]) -> None:
        """Grad hook (a worker thread): mark masters complete; release full buckets."""
        with self._lock:
            rnd = self._round
            if rnd is None:
                return
            for m in masters:
                slot = self._slot.get(id(m))
                if slot is None:
                    continue
                if id(m) in rnd.fired:
                    if rnd.misuse is None:
                        rnd.misuse = RuntimeError(
                            "a master gradient changed after its all-reduce had started: arm() must come "
                            "right before the LAST backward (forward_backward) of the optimizer step, "
                            "not earlier in the accumulation window"
                        )
                    continue
                rnd.fired.add(id(m))
                rnd.remaining[slot] -= 1
                if rnd.remaining[slot] == 0:
                    rnd.ready[slot].set()

    # -- the reduction --------------------------------------------------------------------------
    def _reduce(self, rnd: _Round) -> None:
        """Issue one async all-reduce per bucket in the fixed order, then wait for each
        and write the result back into ``.grad``. Errors are kept for ``finish()``."""
        try:
            # An asynchronous optimizer step still in flight reads and clears the grads.
            # Accumulating a gradient waits for it, but a master of a stage that produced
            # no gradient at all is reported without that wait: wait here too.
            wait_step = getattr(self.rp, "_wait_step_done", None)
            if wait_step is not None:
                wait_step()
            pending = []
            for b in self.buckets:
                while not rnd.ready[b.index].wait(_POLL_S):
                    if rnd.aborted.is_set():
                        return
                if rnd.aborted.is_set():
                    return  # do not issue a collective our peers may never match
                buf = b.flatten()
                if _is_nccl(self.group):
                    buf = buf.to(_comm_device(self.group), non_blocking=True)
                if not rnd.issue_times:
                    rnd.issue_times.append(time.perf_counter())
                work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                pending.append((b, buf, work))
            divisor = self.world_size if self.op == "mean" else 1
            for b, buf, work in pending:
                if self.timeout is None:
                    work.wait()
                else:
                    work.wait(self.timeout)
                b.unflatten(buf.cpu() if buf.device.type != "cpu" else buf, divisor)
            if rnd.issue_times:
                rnd.issue_times.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - handed to finish() on the caller's thread
            rnd.error = rnd.error or exc

    def finish(self) -> None:
        """Complete the reduction; on return every master's ``.grad`` is the sum (or
        mean) over ranks. Treats all gradients as complete now. Collective: every rank
        must call it once per optimizer step, skipped steps included.

        Raises:
            RuntimeError: a collective failed or timed out (a peer died or stalled), or
                the overlap was armed too early; the original error is chained.
        """
        self._check_open()
        start = time.perf_counter()
        with self._lock:
            rnd, self._round = self._round, None
        if self.world_size == 1:
            return
        if rnd is None:
            rnd = _Round(self.buckets)
            rnd.set_all_ready()
            self._reduce(rnd)
        else:
            rnd.set_all_ready()
            assert rnd.thread is not None
            while rnd.thread.is_alive():
                rnd.thread.join(0.5)  # short joins keep Ctrl-C working
        self.last_finish_wait_s = time.perf_counter() - start
        self.last_reduce_s = (
            rnd.issue_times[-1] - rnd.issue_times[0] if len(rnd.issue_times) == 2 else 0.0
        )
        if rnd.misuse is not None:
            raise rnd.misuse
        if rnd.error is not None:
            rank = dist.get_rank(self.group) if dist.is_initialized() else 0
            raise RuntimeError(
                f"gradient all-reduce failed on rank {rank} of {self.world_size}: a peer process may have "
                f"died or stalled (collectives are bounded by the process-group timeout; set it with "
                f"timeout= / {TIMEOUT_ENV}): {rnd.error}"
            ) from rnd.error

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this GradientAllReducer is closed; make a new one")

    def abort(self) -> None:
        """Drop an armed round without issuing any further collective (after a failed
        pipelined call). Peers waiting on this rank fail at the group's timeout."""
        with self._lock:
            rnd, self._round = self._round, None
        if rnd is not None:
            rnd.aborted.set()
            rnd.set_all_ready()

    def close(self) -> None:
        """Abort any armed round, remove the grad hook and free the reducer's own group."""
        self._closed = True
        self.abort()
        if self._remove_hook is not None:
            self._remove_hook()
            self._remove_hook = None
        if self._owns_group and self.group is not None:
            group, self.group = self.group, None
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError, AssertionError):
                pass  # the default group is already gone (teardown order); nothing left to free

    def __enter__(self) -> GradientAllReducer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _unique_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must be tensors (parameters), got {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def sync_gradients(
    rp: Any, group: Any | None = None, op: str = "mean", bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """All-reduce ``rp``'s master gradients now (no overlap). Collective.

    Equivalent to ``GradientAllReducer(rp, group, op, overlap=False).finish()`` on the
    default group (called from the training loop's own thread, so no group of its own
    is needed -- and creating one every step would cost a rendezvous).
    """
    if group is None and _world(None) > 1:
        group = dist.group.WORLD
    reducer = GradientAllReducer(rp, group, op=op, bucket_bytes=bucket_bytes, overlap=False)
    try:
        reducer.finish()
    finally:
        reducer.close()


def flat_grad_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients of ``params`` (what one all-reduce round moves per rank)."""
    return sum(p.numel() * p.element_size() for p in params)


def _raw_optimizer(opt: Any) -> Any:
    """The torch optimizer behind a Lightning ``LightningOptimizer`` (or ``opt`` itself)."""
    return getattr(opt, "_optimizer", opt)


class DataParallel:
    """Everything a training loop (the Lightning strategy) needs for data parallel
    RoundPipe over several processes, behind five calls:

    ========================  ====================================================
    ``connect(env, world)``   create the process group (``world_size > 1`` only)
    ``attach(rp, opts)``      broadcast rank 0's weights; one reducer per optimizer
    ``wrap_closure(opt, c)``  arm that optimizer's reducer, then run ``c`` (the
                              window's last training step): overlap its backward
    ``reduce(opt)``           finish: that optimizer's gradients are reduced
    ``abort()`` / ``detach()``  after an exception / at teardown
    ========================  ====================================================

    In one process every call is a cheap no-op, so a strategy can call them
    unconditionally.

    Args:
        op: "mean" (as DDP) or "sum" of the gradients over processes.
        overlap: start reducing buckets from the grad hook during the last backward.
            Used when there is a single optimizer (with several, the steps of manual
            optimization each reduce their own parameters at ``reduce()``).
        bucket_bytes: gradient bytes per all-reduce.
        timeout: process-group timeout (seconds / ``timedelta``; default
            ``$ROUNDPIPE_DIST_TIMEOUT`` or 30 minutes).

    The default group is gloo: everything the strategy communicates -- master
    gradients, logged metrics (its root device is the CPU), broadcast objects --
    lives in host memory, which NCCL cannot reduce.
    """

    def __init__(
        self,
        op: str = "mean",
        overlap: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float | int | timedelta | None = None,
    ) -> None:
        if op not in _OPS:
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.op = op
        self.overlap = bool(overlap)
        self.bucket_bytes = bucket_bytes
        self.timeout = resolve_timeout(timeout)
        self._reducers: dict[int, GradientAllReducer] = {}

    @property
    def world_size(self) -> int:
        return _world(None)

    def connect(
        self, cluster_environment: Any | None = None, world_size: int | None = None
    ) -> None:
        """Create the default process group when the job has several processes.

        Args:
            cluster_environment: the strategy's Lightning ``ClusterEnvironment`` (None: read
                the environment).
            world_size: the number of processes (the strategy's ``world_size``); 1 = no-op.
        """
        if world_size is None:
            world_size = cluster_environment.world_size() if cluster_environment is not None else 1
        if world_size > 1:
            init_process_group(cluster_environment, backend="gloo", timeout=self.timeout)

    def attach(self, rp: Any, optimizers: Sequence[Any] = ()) -> None:
        """Make every rank hold rank 0's weights and build the reducers (collective).

        Call after the RoundPipe is built and the optimizers point at its masters; again
        after re-building either (the old reducers are closed first).
        """
        self.detach()
        if self.world_size == 1:
            return
        broadcast_masters(rp)
        raws = [_raw_optimizer(o) for o in optimizers]
        for raw in raws:
            params = [p for g in raw.param_groups for p in g["params"]]
            self._reducers[id(raw)] = GradientAllReducer(
                rp,
                op=self.op,
                bucket_bytes=self.bucket_bytes,
                overlap=self.overlap and len(raws) == 1,
                timeout=self.timeout,
                params=params,
            )

    def wrap_closure(self, optimizer: Any, closure: Any) -> Any:
        """``closure`` preceded by arming ``optimizer``'s reducer (``closure`` itself when
        there is nothing to overlap)."""
        reducer = self._reducers.get(id(_raw_optimizer(optimizer)))
        if reducer is None or not reducer.overlap:
            return closure

        def armed_closure(*args: Any, **kwargs: Any) -> Any:
            reducer.arm()
            return closure(*args, **kwargs)

        return armed_closure

    def reduce(self, optimizer: Any) -> None:
        """All-reduce ``optimizer``'s gradients (finish its armed round). Collective:
        every rank calls it for every optimizer step, skipped steps included."""
        reducer = self._reducers.get(id(_raw_optimizer(optimizer)))
        if reducer is not None:
            reducer.finish()

    def abort(self) -> None:
        """Drop armed rounds without further collectives (after an exception)."""
        for r in self._reducers.values():
            r.abort()

    def detach(self) -> None:
        """Close the reducers (their groups and grad hooks). The default group stays."""
        reducers, self._reducers = list(self._reducers.values()), {}
        for r in reducers:
            r.close()
