"""The gradients of a stage run as several jobs at once (``Job.replicas`` > 1: the
one-stage fused plan on CPU workers that compute side by side, one job per worker on its
slice of the microbatches). The jobs finish in any order; their gradients are kept and
handed to the run's grad sink in slice order once all are in, so a call's gradients do
not depend on timing: two runs give the same bits.
"""

from __future__ import annotations

import threading

import torch

from ..planning.schedule import Job
from .transfer import GradSinkMany, StageReplica, download_grads

__all__ = ["JobGrads", "replica_microbatches"]


class JobGrads:
    """Where a run's jobs put their gradients (``PipelineRun.job_grads``): the run's
    one-call-per-job sink (``transfer.batched_sink``)."""

    def __init__(self, sink_many: GradSinkMany) -> None:
        self._sink_many = sink_many
        self._lock = threading.Lock()
        # per replicated stage (kind, stage): each replica's (host params, host grads)
        self._parts: dict[tuple[str, int], dict[int, tuple[list, list]]] = {}

    def download(self, job: Job, stage: StageReplica) -> None:
        """Download ``job``'s gradients: to the sink, or for a replica kept until its
        stage's last one is in, which hands them all on in slice order."""
        if job.replicas == 1:
            download_grads(stage, self._sink_many)
            return
        kept: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        download_grads(stage, lambda ps, gs: kept.append((ps, gs)))  # one call
        key = (str(job.kind), job.stage)
        with self._lock:
            parts = self._parts.setdefault(key, {})
            parts[job.replica] = kept[0] if kept else ([], [])
            if len(parts) < job.replicas:
                return
            del self._parts[key]
        # the sink sums what it is given in the order given (GradBuffer: the first
        # gradient of a master is kept, the next ones added to it): slice order
        for k in range(job.replicas):
            ps, gs = parts[k]
            if ps:
                self._sink_many(ps, gs)


def replica_microbatches(job: Job) -> int:
    """What a job's time is divided by to be per microbatch once every replica of its
    stage added its share to the timer: its microbatches x its stage's replicas."""
    return len(job.microbatches) * job.replicas
