"""The gradients of a stage run as several jobs at once (``Job.replicas`` > 1).

The one-stage fused plan on CPU workers that compute side by side runs as one fused job
per worker, each on its own slice of the microbatches (``schedule.build_schedule``). The
jobs finish in whatever order the workers do; their gradients are kept per job and summed
in the order of the slices (job 0's first) once all of them are in, so the gradients of a
call do not depend on timing: two runs give the same bits. They reach the run's grad sink
then, one call per replica in slice order (the sink sums them, as it sums a parameter's
gradients from two stages).
"""

from __future__ import annotations

import threading

import torch

from ..planning.schedule import Job
from .transfer import GradSink, GradSinkMany, StageReplica, download_grads

__all__ = ["JobGrads", "replica_microbatches"]


class JobGrads:
    """Where a run's jobs put the gradients they downloaded (``PipelineRun.job_grads``).

    Args:
        sink / sink_many: the run's grad sink and its one-call-per-job form (or None).
    """

    def __init__(self, sink: GradSink, sink_many: GradSinkMany | None) -> None:
        self._sink = sink
        self._sink_many = sink_many
        self._lock = threading.Lock()
        # per replicated stage (kind, stage): each replica's (host params, host grads)
        self._parts: dict[tuple[str, int], dict[int, tuple[list, list]]] = {}

    def download(self, job: Job, stage: StageReplica) -> None:
        """Download ``stage``'s gradients (those of ``job``): straight to the sink for a
        stage run as one job; for a replica, kept until its stage's last replica is in,
        which then hands every replica's gradients to the sink in slice order."""
        if job.replicas == 1:
            download_grads(stage, self._sink, self._sink_many)
            return
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []

        def keep(ps: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
            params.extend(ps)
            grads.extend(gs)

        download_grads(stage, lambda p, g: keep([p], [g]), keep)
        key = (str(job.kind), job.stage)
        with self._lock:
            parts = self._parts.setdefault(key, {})
            parts[job.replica] = (params, grads)
            if len(parts) < job.replicas:
                return
            del self._parts[key]
        # the sink sums what it is given in the order given (GradBuffer: the first
        # gradient of a master is kept, the next ones added to it): slice order
        for k in range(job.replicas):
            ps, gs = parts[k]
            if not ps:
                continue
            if self._sink_many is not None:
                self._sink_many(ps, gs)
                continue
            for p, g in zip(ps, gs):
                self._sink(p, g)


def replica_microbatches(job: Job) -> int:
    """What a job's measured time is divided by to be a per-microbatch time once every
    replica of its stage added its share (``ModelTimer`` sums a layer's records of one
    iteration): its own microbatches times the number of replicas (1 for a stage run
    as one job)."""
    return len(job.microbatches) * job.replicas
