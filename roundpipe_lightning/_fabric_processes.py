"""Where a :class:`~roundpipe_lightning.RoundPipeFabricStrategy` process stands among
the others: as under the Trainer, one process per node drives the node's whole device
pool, and several nodes are data parallel over :mod:`roundpipe_core.distributed`
(gloo; identities in one process).

A base class of the Fabric strategy, kept apart so each file has one job: the launch
check, the ranks Fabric reads (``fabric.global_rank``, ``fabric.world_size``), the
sampler arguments of ``fabric.setup_dataloaders`` and the collectives
(``fabric.all_reduce`` / ``all_gather`` / ``barrier`` / ``broadcast``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from roundpipe_core import distributed as D

from ._arguments import crowded_node, crowded_node_error, not_launched_error
from ._setup import op_name

__all__ = ["FabricProcesses"]

_OWNER = "RoundPipeFabricStrategy"


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


class FabricProcesses(SingleDeviceStrategy):
    """Ranks, launch check and collectives of a RoundPipe Fabric run (see the module
    docstring). To Fabric it stays a single-device strategy: one process drives its
    node's pool, so there is nothing for ``fabric.launch()`` to start."""

    cluster_environment: ClusterEnvironment | None
    parallel_devices: list[Any] | None
    _num_nodes: int
    _process_group_timeout: timedelta

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    # -- ranks (Fabric reads them with getattr) ------------------------------------------------
    # SingleDeviceStrategy.__init__ assigns the one-process values (0, 0, 1); the cluster
    # environment decides, so the setters ignore them
    @property
    def world_size(self) -> int:
        env = self.cluster_environment
        return env.world_size() if env is not None else 1

    @world_size.setter
    def world_size(self, _ignored: int) -> None:
        pass

    @property
    def global_rank(self) -> int:
        env = self.cluster_environment
        return env.global_rank() if env is not None else 0

    @global_rank.setter
    def global_rank(self, _ignored: int) -> None:
        pass

    @property
    def node_rank(self) -> int:
        env = self.cluster_environment
        return env.node_rank() if env is not None else 0

    @property
    def local_rank(self) -> int:
        return 0  # one process per node

    @local_rank.setter
    def local_rank(self, _ignored: int) -> None:
        pass

    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """``fabric.setup_dataloaders`` gives each node a ``DistributedSampler`` shard
        (None in one process: the loader stays as it is)."""
        if self.world_size == 1:
            return None
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _set_world_ranks(self) -> None:
        """Called by Fabric's connector once ``num_nodes`` is known: one rank per node."""
        env = self.cluster_environment
        if env is not None and self._num_nodes > 1:
            env.set_global_rank(env.node_rank())
            env.set_world_size(self._num_nodes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    # -- the launch ------------------------------------------------------------------------------
    def _check_processes(self) -> None:
        """Refuse a launch that puts several processes on one node (each would claim all
        of the node's devices) or several processes not started by a launcher."""
        env = self.cluster_environment
        processes = max(env.world_size() if env is not None else 1, _env_world_size())
        local_rank = env.local_rank() if env is not None else 0
        crowded = crowded_node(local_rank, processes, self._num_nodes)
        if crowded is not None:
            devices = str(len(self.parallel_devices or [None]))
            raise crowded_node_error(_OWNER, "Fabric", devices, crowded)
        if self._num_nodes > 1 and (env is None or not env.creates_processes_externally):
            raise not_launched_error(_OWNER, self._num_nodes)

    def _connect(self) -> None:
        """Create the default (gloo) process group when there are several nodes."""
        if self.world_size > 1:
            D.init_process_group(
                self.cluster_environment, backend="gloo", timeout=self._process_group_timeout
            )

    # -- collectives -----------------------------------------------------------------------------
    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor | Any:
        if not isinstance(tensor, Tensor) or self.world_size == 1:
            return tensor
        return D.all_reduce(tensor, op_name(reduce_op), group)

    @override
    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        if self.world_size == 1:
            return tensor
        if sync_grads:
            raise NotImplementedError(
                f"{_OWNER}: all_gather(sync_grads=True) is not supported (the model state is "
                "on the host, outside autograd across processes)"
            )
        return D.all_gather(tensor, group)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.world_size > 1:
            D.barrier(timeout=self._process_group_timeout)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if self.world_size == 1:
            return obj
        return D.broadcast_object(obj, src)
