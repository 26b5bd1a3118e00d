"""Sharding the host state across data-parallel ranks (``shard_host_state=True``): the
scheme (ownership by :func:`partition_by_bytes`, reduce to the owner, step, all-gather
into the model weights, published in version order for asynchronous steps) is
docs/multi-node.md's "Sharding the host state". Each purpose has a group of its own
(reduction, all-gather, norm for clipping), so threads never interleave collectives on
one group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..kinds import check_int
from .buckets import (
    DEFAULT_BUCKET_BYTES,
    BufferRing,
    _Bucket,
    _bucketize,
    _unique_params,
    copy_from_flat,
)
from .group import collective, destroy_group, group_size, new_group
from .reducer import GradientAllReducer

__all__ = [
    "HostShard",
    "ShardedGradientReducer",
    "kept_buffer_bytes",
    "partition_by_bytes",
    "state_bytes",
]


def partition_by_bytes(params: Sequence[torch.Tensor], world_size: int) -> list[int]:
    """The owner rank of each of ``params``: ``world_size`` contiguous runs balanced by
    bytes (a parameter goes to the rank whose share holds its midpoint). Deterministic.

    Raises:
        ValueError: ``world_size`` is not a positive int.
    """
    check_int(world_size, "world_size")
    total = sum(p.nbytes for p in params)
    owners: list[int] = []
    start = 0
    for p in params:
        n = p.nbytes
        mid = start + n / 2
        owners.append(min(world_size - 1, int(mid * world_size // total)) if total else 0)
        start += n
    return owners


def _gather_plan(
    params: list[torch.Tensor],
    owners: list[int],
    world_size: int,
    bucket_bytes: int,
    where: dict[int, torch.Tensor],
) -> list[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
    """The all-gather's buckets, per owner in forward order: (owner, its parameters, where
    the other ranks write them: ``where``, else the parameter itself)."""
    plan = []
    for rank in range(world_size):
        mine = [p for p, o in zip(params, owners) if o == rank]
        taken = 0
        for bucket in _bucketize([where.get(id(p), p) for p in mine], bucket_bytes):
            plan.append((rank, mine[taken : taken + len(bucket)], bucket))
            taken += len(bucket)
    return plan


def _reduce_plan(
    params: list[torch.Tensor], owner: Callable[[torch.Tensor], int], bucket_bytes: int
) -> list[list[torch.Tensor]]:
    """The reduction's buckets: runs of one owner cut into one-dtype buckets."""
    runs: list[list[torch.Tensor]] = []
    for p in params:
        if runs and owner(runs[-1][0]) == owner(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return [b for run in runs for b in _bucketize(run, bucket_bytes)]


def _largest(buckets: Iterable[list[torch.Tensor]]) -> dict[torch.dtype, int]:
    """Per dtype, the elements of the largest bucket."""
    out: dict[torch.dtype, int] = {}
    for b in buckets:
        out[b[0].dtype] = max(out.get(b[0].dtype, 0), sum(t.numel() for t in b))
    return out


def kept_buffer_bytes(
    params: Iterable[torch.Tensor],
    world_size: int,
    bucket_bytes: int,
    targets: dict[int, torch.Tensor] | None = None,
) -> int:
    """Host bytes a sharded rank keeps for one optimizer's collectives: the reduction's
    ring and one all-gather buffer per dtype (``targets`` as for :class:`HostShard`)."""
    params = _unique_params(params)
    if world_size == 1 or not params:
        return 0
    owners = partition_by_bytes(params, world_size)
    owner = dict(zip((id(p) for p in params), owners))
    reduce = _reduce_plan(list(reversed(params)), lambda p: owner[id(p)], bucket_bytes)
    gather = _gather_plan(params, owners, world_size, bucket_bytes, targets or {})
    largest = _largest(b for _, _, b in gather)
    return BufferRing.nbytes(reduce) + sum(n * d.itemsize for d, n in largest.items())


class HostShard:
    """One optimizer's parameters split across the ranks. Creating it is collective (two
    groups): every rank builds its shards in one order.

    Args:
        params: the optimizer's parameters (RoundPipe masters, in param-group order).
        bucket_bytes: bytes per broadcast of the all-gather.
        timeout: bound on each collective of its groups (default: the process group's).
        targets: ``id(param) -> tensor`` the non-owners write a parameter's update into
            (the model weight of a released master); default the parameter itself.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        bucket_bytes: int,
        timeout: float | int | timedelta | None = None,
        targets: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.params = _unique_params(params)
        self.world_size = group_size(None)
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        owners = partition_by_bytes(self.params, self.world_size)
        self._owner = {id(p): o for p, o in zip(self.params, owners)}
        self.owned = [p for p, o in zip(self.params, owners) if o == self.rank]
        self._gather_group = new_group(timeout) if self.world_size > 1 else None
        self._norm_group = new_group(timeout) if self.world_size > 1 else None
        self._gather_buckets = _gather_plan(
            self.params, owners, self.world_size, bucket_bytes, targets or {}
        )
        self._gather_flat: dict[torch.dtype, torch.Tensor] = {}  # made once, reused

    def owner(self, param: torch.Tensor) -> int:
        """The rank that owns ``param`` (KeyError for a tensor not in the shard)."""
        return self._owner[id(param)]

    def owns(self, param: torch.Tensor) -> bool:
        return self._owner.get(id(param)) == self.rank

    def gather(self) -> None:
        """Broadcast each owner's updated parameters into every other rank's copy.
        Collective: inside every synchronous step and after loading a checkpoint.

        Raises:
            CollectiveError: a peer died or stalled (the group's timeout), naming this rank.
        """
        if self.world_size == 1:
            return
        for src, sources, bucket in self._gather_buckets:
            self._broadcast_bucket(src, sources, bucket, write_own=False)

    @property
    def keys(self) -> list[int]:
        """Ids of every parameter of the shard (the masters :meth:`publish` publishes)."""
        return [id(p) for p in self.params]

    def publish(
        self,
        version: int,
        claim: Callable[[Sequence[int]], None],
        mark: Callable[[Sequence[int]], None],
    ) -> None:
        """Publish weight version ``version`` into every rank's model (a remote publisher
        of ``stepping.versions``): per bucket in forward order, ``claim`` it, broadcast,
        write the model weights on every rank, ``mark`` it. Collective, in version order.

        Raises:
            CollectiveError: a peer died or stalled (the group's timeout), naming this rank.
            PoolError: a pipelined iteration failed while this rank waited to write.
        """
        if self.world_size == 1:
            return
        for src, sources, bucket in self._gather_buckets:
            keys = [id(t) for t in sources]
            claim(keys)
            self._broadcast_bucket(src, sources, bucket, write_own=True)
            mark(keys)

    def _broadcast_bucket(
        self,
        src: int,
        sources: list[torch.Tensor],
        bucket: list[torch.Tensor],
        write_own: bool,
    ) -> None:
        """Rank ``src`` broadcasts ``sources`` (cast); the others (``src`` too with
        ``write_own``) copy them into ``bucket``."""
        group = self._gather_group
        if group is None:
            raise RuntimeError("this HostShard is closed (DataParallel.detach()); attach again")
        flat = self._flat_for(bucket)
        if src == self.rank:  # (cast where the destination is a weight of another dtype)
            off = 0
            with torch.no_grad():
                for t in sources:
                    flat[off : off + t.numel()].copy_(t.detach().reshape(-1))
                    off += t.numel()
        with collective(f"all-gather of the updated weights (rank {src}'s share)", group):
            dist.broadcast(flat, src=src, group=group)
        if src != self.rank or write_own:
            copy_from_flat(flat, bucket)

    def _flat_for(self, bucket: list[torch.Tensor]) -> torch.Tensor:
        """A view of the kept buffer of the bucket's dtype (made once: one freed every step
        would stay in glibc's heaps, ``buckets.BufferRing``)."""
        dtype = bucket[0].dtype
        flat = self._gather_flat.get(dtype)
        if flat is None:
            size = _largest(b for _, _, b in self._gather_buckets)[dtype]
            flat = self._gather_flat[dtype] = torch.empty(size, dtype=dtype)
        return flat[: sum(t.numel() for t in bucket)]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over all ranks' shares (one all-reduce of the
        norm; each rank scales its own). Collective; returns the total norm."""
        norm_type = float(norm_type)
        grads = [p.grad for p in self.owned if p.grad is not None]
        norms = list(torch._foreach_norm(grads, norm_type)) if grads else []
        if math.isinf(norm_type):
            local = torch.stack(norms).max() if norms else torch.zeros(())
            op = dist.ReduceOp.MAX
        else:
            local = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros(())
            op = dist.ReduceOp.SUM
        total = local.double().reshape(1)
        if self.world_size > 1:
            if self._norm_group is None:
                raise RuntimeError("this HostShard is closed (DataParallel.detach()); attach again")
            with collective("gradient-norm all-reduce", self._norm_group):
                dist.all_reduce(total, op=op, group=self._norm_group)
        total_norm = total[0] if math.isinf(norm_type) else total[0] ** (1.0 / norm_type)
        total_norm = total_norm.float()
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        return total_norm

    def drop_foreign_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Delete ``optimizer``'s state of parameters this rank does not own."""
        for p in [p for p in optimizer.state if id(p) in self._owner and not self.owns(p)]:
            del optimizer.state[p]

    def close(self) -> None:
        destroy_group(self._gather_group)
        destroy_group(self._norm_group)
        self._gather_group = self._norm_group = None
        self._gather_flat.clear()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (what sharding divides by N)."""
    return sum(
        v.nbytes
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


class ShardedGradientReducer(GradientAllReducer):
    """:class:`GradientAllReducer` that reduces each bucket to its owner only.

    Args:
        rp / op / bucket_bytes / overlap / timeout: as for :class:`GradientAllReducer`.
        shard: the :class:`HostShard` of the optimizer whose parameters are reduced.
    """

    def __init__(
        self,
        rp: Any,
        shard: HostShard,
        op: str = "mean",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        timeout: float | int | timedelta | None = None,
    ) -> None:
        self.shard = shard
        super().__init__(
            rp,
            op=op,
            bucket_bytes=bucket_bytes,
            overlap=overlap,
            timeout=timeout,
            params=shard.params,
        )

    def _group_params(
        self, params: list[torch.Tensor], bucket_bytes: int
    ) -> list[list[torch.Tensor]]:
        return _reduce_plan(params, self.shard.owner, bucket_bytes)

    def _issue(self, bucket: _Bucket, buf: torch.Tensor) -> Any:
        owner = self.shard.owner(bucket.params[0])
        return dist.reduce(buf, dst=owner, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def _land(self, bucket: _Bucket, buf: torch.Tensor, divisor: int) -> None:
        if self.shard.owns(bucket.params[0]):
            bucket.unflatten(buf, divisor)
        else:
            for p in bucket.params:
                p.grad = None  # sent to its owner: this rank keeps no gradient for it
