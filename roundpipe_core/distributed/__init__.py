"""Data parallel RoundPipe across processes and nodes over ``torch.distributed``.

Each process holds a full RoundPipe and trains on its shard of the data; the host
master gradients are all-reduced (gloo) before every step (docs/multi-node.md). Nothing
here imports Lightning. A peer that dies or stalls makes the others raise :class:`CollectiveError` at the group's
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
