"""The iteration's schedule as data: plan + dispatch policy -> an ordered job list.

This is the single place that decides which device runs which stage and in
which order. The runtime executes the list, the simulator times the same list,
and the timer / stage-time logger annotate it. Dispatch is round-robin
(``job k -> device (start_device + k) mod N``) unless the plan pins a stage to
an owner device.
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import ModelExecutePlan

FORWARD = "forward"
FUSED = "fused"
BACKWARD = "backward"


@dataclass(frozen=True)
class Job:
    """One stage execution: upload its layers to ``device``, run every microbatch, drop them.

    Attributes:
        index: position in launch order within the schedule.
        kind: ``"forward"`` (no autograd; saves stage inputs for recompute),
            ``"fused"`` (forward + loss + backward of the last layers) or
            ``"backward"`` (recompute + backward).
        layers: the layer indices of the stage.
        device: index of the device in the pool that runs it.
        microbatches: the microbatch indices, run in this order.
        stage: index of the stage in its plan (``fwd_plan`` for forward jobs,
            ``bwd_plan`` for fused/backward jobs).
    """

    index: int
    kind: str
    layers: range
    device: int
    microbatches: range
    stage: int


def build_schedule(
    plan: ModelExecutePlan,
    run_type: str,
    num_devices: int,
    num_microbatch: int,
    phase: str = "all",
    start_device: int = 0,
) -> list[Job]:
    """Build the launch-ordered job list of one iteration.

    Args:
        plan: a plan already validated for ``run_type``.
        run_type: ``"infer"``, ``"train"`` (forward now, backward through autograd
            later) or ``"fused"`` (``forward_backward``).
        num_devices: size of the device pool.
        num_microbatch: microbatches per stage.
        phase: ``"all"``, ``"forward"`` or ``"backward"`` — "train" runs its forward
            and backward phases as two separate schedules.
        start_device: round-robin offset of the first job (the backward phase of
            "train" continues where its forward phase stopped).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if num_microbatch < 1:
        raise ValueError(f"num_microbatch must be >= 1, got {num_microbatch}")
    mbs = range(num_microbatch)
    entries: list[tuple[str, range, int, int | None]] = []
    do_fwd = phase in ("all", "forward")
    do_bwd = phase in ("all", "backward")
    if run_type in ("infer", "train", "fused") and do_fwd:
        owners = plan.fwd_owners
        for i, r in enumerate(plan.fwd_plan):
            entries.append((FORWARD, r, i, owners[i] if owners else None))
    if run_type == "fused" and do_fwd:
        owners = plan.bwd_owners
        for i, r in enumerate(plan.bwd_plan):
            entries.append((FUSED if i == 0 else BACKWARD, r, i, owners[i] if owners else None))
    if run_type == "train" and do_bwd:
        owners = plan.bwd_owners
        for i, r in enumerate(plan.bwd_plan):
            entries.append((BACKWARD, r, i, owners[i] if owners else None))
    jobs = []
    for k, (kind, r, stage, owner) in enumerate(entries):
        device = owner if owner is not None else (start_device + k) % num_devices
        jobs.append(Job(k, kind, r, device, mbs, stage))
    return jobs


def boundary_layers(plan: ModelExecutePlan, run_type: str) -> set[int]:
    """Layer indices whose inputs a forward pass must keep for the backward stages.

    Only each backward stage's input is kept (full recompute); with asymmetric
    plans these need not coincide with forward stage boundaries.
    """
    if run_type == "infer":
        return set()
    return {r.start for r in plan.bwd_plan}


def jobs_by_device(jobs: list[Job], num_devices: int) -> list[list[Job]]:
    """Split a schedule into each device's own queue, keeping launch order."""
    queues: list[list[Job]] = [[] for _ in range(num_devices)]
    for job in jobs:
        queues[job.device].append(job)
    return queues
