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
        if self.world_size > 1 and (env is None or not env.creates_processes_externally):
            raise ValueError(
                f"RoundPipeStrategy with num_nodes={self.num_nodes} runs one process per node, started "
                "by a launcher: torchrun (--nnodes N --nproc-per-node 1), SLURM (srun, one task per node) "
                "or the MASTER_ADDR / MASTER_PORT / WORLD_SIZE / NODE_RANK / LOCAL_RANK=0 environment. "
                "This process was not started that way."
            )
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

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Master weights exist only once RoundPipe is built in setup().
        return True

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
