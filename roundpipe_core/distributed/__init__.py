"""Data parallel RoundPipe across processes and nodes over ``torch.distributed``.

Each process holds a full RoundPipe and trains on its shard of the data; the host
master gradients are all-reduced (gloo) before every step. Nothing here imports Lightning:

* :class:`GradientAllReducer` / :func:`sync_gradients` -- bucketed all-reduce of the
  master gradients, overlapped with the backward through the grad hook or one-shot;
* :class:`DataParallel` -- what a training loop needs (``connect``, ``attach``,
  ``wrap_closure``, ``reduce``, ``abort``, ``detach``);
* :class:`HostShard`, :class:`ShardedGradientReducer` -- ``shard_host_state=True``;
  :func:`save_shard` / :func:`load_shards` / :func:`merge_shards` -- its checkpoints;
* :func:`broadcast_masters` / :func:`params_in_sync` -- start from, and check, one set
  of weights;
* :func:`init_process_group` / :func:`dist_env_from_environ` -- set-up from a Lightning
  ``ClusterEnvironment`` or the environment of torchrun, SLURM or a hand-written launch;
* :func:`all_reduce`, :func:`barrier`, :func:`broadcast_object`, :func:`all_gather`.

A peer that dies or stalls makes the others raise :class:`CollectiveError` at the group's
timeout (``timeout=``, ``ROUNDPIPE_DIST_TIMEOUT``, 30 minutes), never hang.
"""

from .buckets import DEFAULT_BUCKET_BYTES, reduce_buffer_bytes
from .data_parallel import DataParallel
from .group import (
    DEFAULT_TIMEOUT,
    TIMEOUT_ENV,
    CollectiveError,
    DistEnv,
    all_gather,
    all_reduce,
    barrier,
    broadcast_object,
    destroy_process_group,
    dist_env_from_environ,
    init_process_group,
    resolve_timeout,
)
from .reducer import GradientAllReducer, broadcast_masters, params_in_sync, sync_gradients
from .shard_io import load_shards, merge_shards, save_shard, shard_files
from .sharded import (
    HostShard,
    ShardedGradientReducer,
    kept_buffer_bytes,
    partition_by_bytes,
    state_bytes,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "CollectiveError",
    "DataParallel",
    "DistEnv",
    "GradientAllReducer",
    "HostShard",
    "ShardedGradientReducer",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast_masters",
    "broadcast_object",
    "destroy_process_group",
    "dist_env_from_environ",
    "init_process_group",
    "kept_buffer_bytes",
    "load_shards",
    "merge_shards",
    "params_in_sync",
    "partition_by_bytes",
    "reduce_buffer_bytes",
    "resolve_timeout",
    "save_shard",
    "shard_files",
    "state_bytes",
    "sync_gradients",
]
