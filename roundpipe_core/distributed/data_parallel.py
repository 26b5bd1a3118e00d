"""``DataParallel``: the whole multi-process interface a training loop needs."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..kinds import check_flag
from ..running.host_memory import heap_retention_limited
from .buckets import DEFAULT_BUCKET_BYTES, reduce_buffer_bytes
from .group import group_size, init_process_group, resolve_timeout
from .reducer import GradientAllReducer, broadcast_masters, check_reduce_arguments
from .shard_io import load_shards, save_shard
from .sharded import HostShard, ShardedGradientReducer, kept_buffer_bytes

__all__ = ["DataParallel"]

log = logging.getLogger(__name__)


@functools.cache
def _say_heap_once() -> None:
    log.info(
        "shard_host_state=True: with glibc's default malloc a sharded rank keeps some of "
        "the gradients it drops every step in malloc's heaps (peak ~1.03x the host-memory "
        "budget, up to ~1.1x with bf16); launch with MALLOC_MMAP_THRESHOLD_=65536, or call "
        "roundpipe_core.running.host_memory.limit_heap_retention(), for ~1.01x (slower steps "
        "on CPU workers: docs/multi-node.md)"
    )


SYNC_ONLY = (
    "step(is_async=True) with DataParallel(shard_host_state=True) and separate masters "
    "attached for synchronous steps: each rank writes the others' updated weights into its "
    "model inside the step, which must not overlap the next call; pass is_async=False "
    "(RoundPipeStrategy / RoundPipeFabricStrategy: async_step=False), or attach with "
    "DataParallel.attach(rp, optimizers, async_step=True), which publishes them when the "
    "step's weights are published (RoundPipeStrategy / RoundPipeFabricStrategy: "
    "async_step=True)"
)
"""Why a RoundPipe whose masters a shard released refuses an asynchronous step."""


def _raw_optimizer(opt: Any) -> Any:
    """The torch optimizer behind a Lightning ``LightningOptimizer`` (or ``opt`` itself)."""
    return getattr(opt, "_optimizer", opt)


def _params_of(opt: Any) -> list[Any]:
    return [p for g in _raw_optimizer(opt).param_groups for p in g["params"]]


def _gather_targets(rp: Any) -> dict[int, Any]:
    """Where non-owners write a separate master's update: the model weight."""
    masters = getattr(rp, "masters", None)
    return {} if masters is None else {id(m): p for _, p, m in masters.copies}


class DataParallel:
    """Everything a training loop (the Lightning strategy) needs for data parallel
    RoundPipe over several processes: :meth:`connect`, :meth:`attach`,
    :meth:`wrap_closure`, :meth:`reduce`, :meth:`after_step`, :meth:`abort` and
    :meth:`detach` (docs/multi-node.md shows the loop). In one process each is a no-op.

    Args:
        op: "mean" (as DDP) or "sum" of the gradients over processes.
        overlap: start reducing buckets from the grad hook during the last backward
            (with a single optimizer only).
        bucket_bytes: gradient bytes per all-reduce.
        timeout: process-group timeout (seconds / ``timedelta``; default
            ``$ROUNDPIPE_DIST_TIMEOUT`` or 30 minutes).
        shard_host_state: each rank keeps gradients, optimizer state and separate masters
            only for its 1/N of each optimizer's parameters (see :mod:`.sharded`); clip
            with :meth:`clip_grad_norm_`.

    The default group is gloo: everything communicated lives in host memory.
    """

    def __init__(
        self,
        op: str = "mean",
        overlap: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float | int | timedelta | None = None,
        shard_host_state: bool = False,
    ) -> None:
        check_flag(shard_host_state, "shard_host_state")
        check_reduce_arguments(op, bucket_bytes)
        self.op = op
        self.overlap = bool(overlap)
        self.bucket_bytes = bucket_bytes
        self.timeout = resolve_timeout(timeout)
        self.shard_host_state = shard_host_state
        if shard_host_state and not heap_retention_limited():
            _say_heap_once()
        self._reducers: dict[int, GradientAllReducer] = {}
        self._shards: dict[int, HostShard] = {}
        # attach(async_step=True), separate masters: shards publish versions instead
        self.publishes_versions = False
        self._rp: Any = None

    @property
    def world_size(self) -> int:
        return group_size(None)

    @property
    def state_shards(self) -> int:
        """Processes the host state is sharded over (1 unsharded or in one process)."""
        return self.world_size if self.shard_host_state else 1

    def connect(
        self, cluster_environment: Any | None = None, world_size: int | None = None
    ) -> None:
        """Create the default process group from a Lightning ``ClusterEnvironment`` (None:
        the environment) when ``world_size`` (default: the environment's) is above 1."""
        if world_size is None:
            world_size = cluster_environment.world_size() if cluster_environment is not None else 1
        if world_size > 1:
            init_process_group(cluster_environment, backend="gloo", timeout=self.timeout)

    def attach(self, rp: Any, optimizers: Sequence[Any] = (), *, async_step: bool = False) -> None:
        """Make every rank hold rank 0's weights and build the reducers (collective), after
        the optimizers point at ``rp``'s masters; again after re-building either.

        Args:
            rp: the RoundPipe.
            optimizers: the optimizers stepping its masters (one reducer each).
            async_step: whether ``rp``'s steps will be asynchronous (sharded with separate
                masters only): ``False`` all-gathers the updates inside the step (``rp``
                then refuses ``step(is_async=True)``); ``True`` when the step's weights
                are published (``rp.synchronize()`` is then collective meanwhile).
        """
        check_flag(async_step, "async_step")
        self.detach()
        self._shards = {}
        self.publishes_versions = False
        if self.world_size == 1:
            return
        masters = getattr(rp, "masters", None)
        if masters is not None and masters.released:
            # attached before: masters another rank owned restart from the model's weights
            masters.restore_released()
        broadcast_masters(rp)
        raws = [_raw_optimizer(o) for o in optimizers]
        kw: dict[str, Any] = dict(
            op=self.op,
            bucket_bytes=self.bucket_bytes,
            overlap=self.overlap and len(raws) == 1,
            timeout=self.timeout,
        )
        weight_of = _gather_targets(rp)
        # a shared master makes every step synchronous: its shard gathers inside the step
        self.publishes_versions = publishes = (
            self.shard_host_state
            and async_step
            and masters is not None
            and bool(masters.copies)
            and not masters.num_shared
        )
        self._rp = rp
        for raw in raws:
            params = _params_of(raw)
            if self.shard_host_state:
                shard = self._shards[id(raw)] = HostShard(
                    params, self.bucket_bytes, self.timeout, targets=weight_of
                )
                shard.drop_foreign_state(raw)  # a state loaded whole keeps this rank's share
                if masters is not None:  # the masters of its share only
                    foreign = [p for p in params if not shard.owns(p)]
                    masters.release(foreign, None if async_step else SYNC_ONLY)
                    if publishes:
                        masters.publishers.append(shard)
                self._reducers[id(raw)] = ShardedGradientReducer(rp, shard, **kw)
            else:
                self._reducers[id(raw)] = GradientAllReducer(rp, params=params, **kw)

    def kept_buffer_bytes(self, rp: Any, optimizers: Sequence[Any] = ()) -> int:
        """Host bytes of the flat buffers this rank's collectives will keep training ``rp``
        with ``optimizers`` (the host-memory budget's "collective buffers"); no collective."""
        if self.world_size == 1:
            return 0
        params = [_params_of(o) for o in optimizers]
        if self.state_shards == 1:
            return sum(reduce_buffer_bytes(ps, self.world_size, self.bucket_bytes) for ps in params)
        weight_of = _gather_targets(rp)
        return sum(
            kept_buffer_bytes(ps, self.world_size, self.bucket_bytes, weight_of) for ps in params
        )

    def wrap_closure(self, optimizer: Any, closure: Any) -> Any:
        """``closure`` preceded by arming ``optimizer``'s reducer (if it overlaps)."""
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

    def shard(self, optimizer: Any) -> HostShard | None:
        """``optimizer``'s :class:`HostShard` (None unless sharded over several ranks)."""
        return self._shards.get(id(_raw_optimizer(optimizer)))

    def after_step(self, optimizer: Any) -> None:
        """Sharded: all-gather the stepped weights (:meth:`HostShard.gather`). Call it right
        after ``optimizer.step()`` on every rank; a no-op unsharded or where shards publish."""
        shard = self.shard(optimizer)
        if shard is not None and not self.publishes_versions:
            shard.gather()

    def clip_grad_norm_(self, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip ``optimizer``'s reduced gradients by their global norm, as
        ``torch.nn.utils.clip_grad_norm_``; returns the norm (sharded: collective)."""
        shard = self.shard(optimizer)
        if shard is not None:
            return shard.clip_grad_norm_(max_norm, norm_type)
        params = [p for p in _params_of(optimizer) if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def save_state(self, directory: str | Path, rp: Any, optimizer: Any) -> Path | None:
        """Write this rank's share of the host state into ``directory`` (:mod:`.shard_io`;
        unsharded, rank 0 writes one shard). Call it on every rank; returns the file or None."""
        raw, shard, named, layers = self._state_of(rp, optimizer)
        learned = None if layers is None else rp.pool.learned_draws(layers)
        if shard is not None:
            return save_shard(
                directory, named, raw, shard.owns, shard.rank, shard.world_size, learned=learned
            )
        if group_size(None) > 1 and torch.distributed.get_rank() != 0:
            return None
        return save_shard(directory, named, raw, lambda p: True, 0, 1, learned=learned)

    def load_state(self, directory: str | Path, rp: Any, optimizer: Any) -> None:
        """Load shards :meth:`save_state` wrote on any rank count (collective when sharded;
        after :meth:`attach`)."""
        raw, shard, named, layers = self._state_of(rp, optimizer)
        learned = load_shards(
            directory, named, raw, shard.owns if shard is not None else (lambda p: True)
        )
        if learned is not None and layers is not None:
            rp.pool.restore_draws(layers, learned)  # the resumed run computes as before
        if shard is not None:
            shard.drop_foreign_state(raw)
            shard.gather()  # the shares of the others (into the masters or the weights)
        rp.masters.copy_to_model()  # this rank's masters (a released one has no values)

    def _state_of(self, rp: Any, optimizer: Any) -> tuple[Any, HostShard | None, dict, Any]:
        """(raw optimizer, its shard, ``rp``'s named masters, its layers) once no step runs;
        an AutoRoundPipe has no layers (its units learn their own draws)."""
        rp.synchronize()
        raw = _raw_optimizer(optimizer)
        return raw, self.shard(raw), dict(rp.optim_named_parameters()), getattr(rp, "layers", None)

    def abort(self) -> None:
        """Drop armed rounds without further collectives (after an exception)."""
        for r in self._reducers.values():
            r.abort()

    def detach(self) -> None:
        """Close the reducers and the shards' groups; publishing shards first publish the
        last step's weights (``rp.synchronize()``: collective)."""
        self._stop_publishing()
        reducers, self._reducers = list(self._reducers.values()), {}
        for r in reducers:
            r.close()
        # ownership stays until the next attach(): a checkpoint saved after training
        # must still be written shard by shard
        for s in self._shards.values():
            s.close()

    def _stop_publishing(self) -> None:
        """Publish what is pending while the groups are open, then unregister the shards."""
        rp, self._rp = self._rp, None
        masters = getattr(rp, "masters", None)
        if masters is None or not masters.publishers:
            return
        try:
            if not rp._steps.closed:  # (a closed RoundPipe published everything at close())
                rp.synchronize()
        except Exception as exc:  # noqa: BLE001 - teardown after a failure goes on
            log.warning(
                "DataParallel.detach(): publishing the last step's weights failed (%r); the "
                "weights other ranks own may be one step old on this rank",
                exc,
            )
        finally:
            shards = {id(s) for s in self._shards.values()}
            masters.publishers[:] = [p for p in masters.publishers if id(p) not in shards]
