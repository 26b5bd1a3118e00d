"""Where a :class:`~roundpipe_lightning.RoundPipeStrategy` process stands among the
others: one process per node drives the node's whole device pool, the model state
stays on the host, and collectives go through :mod:`roundpipe_core.distributed`
(identities in one process).

A base class of the strategy, kept apart so each file has one job.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from roundpipe_core import distributed as D

from ._arguments import crowded_node, crowded_node_error, not_launched_error
from ._setup import op_name

__all__ = ["ProcessTopologyStrategy"]


class ProcessTopologyStrategy(ParallelStrategy):
    """Ranks, devices and collectives of a RoundPipe run (see the module docstring)."""

    _num_nodes: int
    _dp: D.DataParallel

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def root_device(self) -> torch.device:
        # Model state, batches and losses live on the host; the pool's devices are
        # RoundPipe's business.
        return torch.device("cpu")

    @property
    def compute_devices(self) -> list[torch.device]:
        """The devices of this process's RoundPipe pool (the Trainer's ``devices``)."""
        return list(self.parallel_devices or [torch.device("cpu")])

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # One process per node: the node's whole pool consumes one shard.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def check_launch(self) -> Any:
        """The cluster environment, after checking that this process was started as one
        process per node (the only layout a RoundPipe run has)."""
        env = self.cluster_environment
        local_rank = env.local_rank() if env is not None else 0
        crowded = crowded_node(local_rank, self.world_size, self.num_nodes)
        if crowded is not None:
            devices = str(len(self.compute_devices))
            raise crowded_node_error("RoundPipeStrategy", "Trainer", devices, crowded)
        if self.world_size > 1 and (env is None or not env.creates_processes_externally):
            raise not_launched_error("RoundPipeStrategy", self.num_nodes)
        return env

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank)
            self.cluster_environment.set_world_size(self.num_nodes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def model_to_device(self) -> None:
        # Parameters stay in host memory; RoundPipe uploads stages to its devices.
        return None

    # -- collectives: roundpipe_core.distributed (identities in one process) ----------------------
    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if not isinstance(tensor, Tensor):
            return tensor
        return D.all_reduce(tensor, op_name(reduce_op), group)

    @override
    def barrier(self, name: str | None = None) -> None:
        D.barrier(timeout=self._dp.timeout)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return D.broadcast_object(obj, src)
