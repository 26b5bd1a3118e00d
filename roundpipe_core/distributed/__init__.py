"""Data parallel RoundPipe across processes and nodes over ``torch.distributed``.

RoundPipe drives every GPU of a node from one process; beyond one node (or, for
tests, several processes on one machine) each process holds a full RoundPipe
and the processes are data parallel: each trains on its own shard of the data
and the master gradients are all-reduced before every optimizer step.

The master gradients live on the host (fp32 ``.grad`` of
``rp.optim_parameters()``), so the natural backend is **gloo** over CPU
tensors. NCCL only reduces GPU tensors: with an NCCL group the reducer stages
each bucket through the GPU and back, which pays two PCIe copies per bucket and
only wins on fast inter-node fabrics; gloo is the default.

Nothing here imports Lightning (the Lightning strategy wires it in):

* :class:`GradientAllReducer` -- bucketed all-reduce of the master gradients,
  optionally overlapped with the backward pass through RoundPipe's grad hook, in a
  ring of a few kept flat buffers (:func:`reduce_buffer_bytes`: their bytes);
  :func:`sync_gradients` -- the one-shot, non-overlapped form.
* :class:`DataParallel` -- what a training loop needs: ``connect``, ``attach``,
  ``wrap_closure``, ``reduce``, ``abort``, ``detach``.
* :class:`HostShard`, :class:`ShardedGradientReducer` -- ``DataParallel(shard_host_state=True)``:
  each rank keeps gradients and optimizer state for its 1/N of the parameters only
  (reduce to the owner, step the share, all-gather the weights; see ``sharded.py``).
* :func:`save_shard` / :func:`load_shards` / :func:`merge_shards` -- checkpoints of a
  sharded state: one file per rank, loadable on any rank count, mergeable offline.
* :func:`broadcast_masters` -- make every rank start from rank ``src``'s weights;
  :func:`params_in_sync` -- check that they still agree.
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
the timeout expires. Either way a :class:`CollectiveError` naming the rank is
raised on the calling thread, never a silent hang.
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
