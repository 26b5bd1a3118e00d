"""The iteration's schedule as data: plan + dispatch policy -> an ordered job list, the
one place that decides which device runs which stage (the runtime executes it, the
simulator times it). Dispatch is round-robin (``job k -> device (start_device + k) mod
N``) unless the plan pins a stage. A job prints as ``"<stage><kind code><device>"``
(``"2F0"``, ``"0X1"``, ``"3B0"``), a schedule as those codes separated by spaces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..kinds import JobKind, RunType, check_int, parse_kind
from .plan import ModelExecutePlan, even_ranges

__all__ = [
    "BACKWARD",
    "FORWARD",
    "FUSED",
    "Job",
    "boundary_layers",
    "build_schedule",
    "format_schedule",
    "jobs_by_device",
    "parse_job_code",
    "parse_schedule",
]

# Short names the runtime and tests compare job kinds against.
FORWARD = JobKind.FORWARD
FUSED = JobKind.FUSED
BACKWARD = JobKind.BACKWARD

_CODE = re.compile(r"([0-9]+)([A-Z])([0-9]+)")


@dataclass(frozen=True)
class Job:
    """One stage execution: upload its layers to ``device``, run its microbatches, drop them.

    Attributes:
        index: position in launch order.
        kind: ``FORWARD`` (no autograd), ``FUSED`` (forward + loss + backward) or
            ``BACKWARD`` (recompute + backward).
        stage: index in ``fwd_plan`` (forward jobs) or ``bwd_plan`` (fused/backward).
        replica / replicas: which of ``replicas`` jobs running one stage at once, each on
            its own slice of the microbatches (0 of 1 otherwise).
    """

    index: int
    kind: JobKind
    layers: range
    device: int
    microbatches: range
    stage: int
    replica: int = 0
    replicas: int = 1
    # the text form, made once: the runtime names every transfer it records by it
    _code: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_code", f"{self.stage}{JobKind(self.kind).code}{self.device}")

    @property
    def code(self) -> str:
        """The job's text form, ``"2F0"``: stage, kind code, device."""
        return self._code

    def __str__(self) -> str:
        return self.code


def parse_job_code(text: str) -> tuple[int, JobKind, int]:
    """``"2F0"`` -> ``(2, JobKind.FORWARD, 0)``.

    Raises:
        ValueError: naming the text when it is not ``<stage><F|X|B><device>``.
    """
    m = _CODE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(
            f"job {text!r} is not <stage><kind><device> such as '2F0' (kinds: F, X, B)"
        )
    return int(m.group(1)), JobKind.from_code(m.group(2)), int(m.group(3))


def format_schedule(jobs: list[Job]) -> str:
    """A schedule as text: ``"0F0 1F1 0X0 1B1"``."""
    return " ".join(job.code for job in jobs)


def parse_schedule(text: str, plan: ModelExecutePlan, num_microbatch: int) -> list[Job]:
    """Rebuild the jobs of :func:`format_schedule` output for ``plan``.

    Raises:
        ValueError: a code that does not parse, or names a stage the plan lacks.
    """
    check_int(num_microbatch, "num_microbatch")
    jobs = []
    for k, tok in enumerate(text.split()):
        stage, kind, device = parse_job_code(tok)
        stages = plan.fwd_plan if kind == FORWARD else plan.bwd_plan
        if stage >= len(stages):
            side = "fwd_plan" if kind == FORWARD else "bwd_plan"
            raise ValueError(
                f"job {k} ({tok!r}) names stage {stage} but {side} has {len(stages)} stages"
            )
        jobs.append(Job(k, kind, stages[stage], device, range(num_microbatch), stage))
    return jobs


def build_schedule(
    plan: ModelExecutePlan,
    run_type: RunType | str,
    num_devices: int,
    num_microbatch: int,
    phase: str = "all",
    start_device: int = 0,
    replicas: int = 1,
) -> list[Job]:
    """The launch-ordered job list of one iteration of ``plan`` on ``num_devices``
    devices, ``num_microbatch`` microbatches per stage.

    Args:
        phase: ``"all"``, ``"forward"`` or ``"backward"`` ("train" runs two schedules).
        start_device: round-robin offset of the first job.
        replicas: a one-stage "fused" plan with no owner runs as this many jobs at once
            (at most one per device and microbatch), each on a contiguous slice of the
            microbatches, on devices ``start_device``, ``start_device + 1``, ...
    """
    rt = parse_kind(RunType, run_type, "run_type")
    check_int(num_devices, "num_devices")
    check_int(num_microbatch, "num_microbatch")
    if phase not in ("all", "forward", "backward"):
        raise ValueError(f"phase must be 'all', 'forward' or 'backward', got {phase!r}")
    mbs = range(num_microbatch)
    entries: list[tuple[JobKind, range, int, int | None]] = []
    do_fwd = phase in ("all", "forward")
    do_bwd = phase in ("all", "backward")
    if do_fwd:
        owners = plan.fwd_owners
        for i, r in enumerate(plan.fwd_plan):
            entries.append((FORWARD, r, i, owners[i] if owners else None))
    if (rt == RunType.FUSED and do_fwd) or (rt == RunType.TRAIN and do_bwd):
        owners = plan.bwd_owners
        for i, r in enumerate(plan.bwd_plan):
            kind = FUSED if rt == RunType.FUSED and i == 0 else BACKWARD
            entries.append((kind, r, i, owners[i] if owners else None))
    check_int(replicas, "replicas")
    count = min(replicas, num_devices, num_microbatch)
    if count > 1 and len(entries) == 1 and entries[0][0] == FUSED and entries[0][3] is None:
        _, r, stage, _ = entries[0]
        return [
            Job(k, FUSED, r, (start_device + k) % num_devices, part, stage, k, count)
            for k, part in enumerate(even_ranges(num_microbatch, count))
        ]
    jobs = []
    for k, (kind, r, stage, owner) in enumerate(entries):
        device = owner if owner is not None else (start_device + k) % num_devices
        jobs.append(Job(k, kind, r, device, mbs, stage))
    return jobs


def boundary_layers(plan: ModelExecutePlan, run_type: RunType | str) -> set[int]:
    """Layers whose inputs a forward keeps for the backward: each backward stage's first."""
    if parse_kind(RunType, run_type, "run_type") == RunType.INFER:
        return set()
    return {r.start for r in plan.bwd_plan}


def jobs_by_device(jobs: list[Job], num_devices: int) -> list[list[Job]]:
    """Split a schedule into each device's own queue, keeping launch order."""
    queues: list[list[Job]] = [[] for _ in range(num_devices)]
    for job in jobs:
        queues[job.device].append(job)
    return queues
