"""Automatic planning (:func:`auto`, ``ModelExecutePlan.auto``): each model's
:class:`~roundpipe_core.planning.profile.LayerProfile` searched
(:func:`~roundpipe_core.planning.search.search_plans`) under a per-stage memory cap; the
re-plan policy (:func:`decide_replan`) and the CPU workers' replicas.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..kinds import RunType, check_flag, check_int, parse_kind
from .plan import ModelExecutePlan, default_num_microbatch
from .profile import LayerProfile, profile_of
from .search import fewest_stage_plans, search_plans
from .simulate import simulated_iteration_ms

__all__ = [
    "DEFAULT_MEMORY_SHARE",
    "ReplanDecision",
    "auto",
    "decide_replan",
    "fused_replicas",
    "may_replicate",
    "most_fused_replicas",
    "predicted_speedup",
    "replicable",
    "split_plan",
]

#: Share of the smallest device's memory that ``auto()`` plans with by default.
DEFAULT_MEMORY_SHARE = 0.6
_GB = 1024**3


def auto(
    run_type: RunType | str,
    *models: Any,
    min_stages: int | None = None,
    upper_threshold: float = 1.1,
    model_memory_limit: float | None = None,
    method: str = "exact",
    objective: str = "pipeline",
    num_microbatch: int | None = None,
    refine: bool = True,
    overlap_iterations: bool = False,
    concurrent: bool | None = None,
) -> ModelExecutePlan | list[ModelExecutePlan]:
    """Plan stages from measured layer times (``ModelExecutePlan.auto``, whose overloads
    type the one-model and several-model forms).

    Each stage's memory stays under ``model_memory_limit / 2`` (the next stage's
    parameters are prefetched; the whole limit on CPU workers that lend the host's), and
    the objective is minimised over the stage-time caps: docs/layouts-and-planner.md
    ("Automatic planning") says how and why it differs from the published planner.

    Args:
        run_type: "infer", "train" (``forward()`` then backward through autograd)
            or "fused" (``forward_backward()``).
        *models: RoundPipe models, :class:`~roundpipe_core.running.timer.ModelTimer` or
            :class:`LayerProfile` objects; several are planned jointly with one shared
            stage cap (e.g. an encoder and a decoder run one after another).
        min_stages: for ``objective="stages"``; default the number of devices (the
            largest pool; "pipeline" uses it as the device count when no model has one).
        upper_threshold: search window of ``method="greedy"``.
        model_memory_limit: GB a device may use for the model; default 60% of the
            smallest device's memory (CPU workers: ``ROUNDPIPE_CPU_DEVICE_MEMORY_GB``,
            8 GB unless set). A layer bigger than a stage's share raises it, with a warning.
        method: "exact" (default) or "greedy".
        objective: "pipeline" (default) or "stages" (the published cost).
        num_microbatch: for "pipeline"; default RoundPipe's
            (:func:`~roundpipe_core.planning.plan.default_num_microbatch`): devices + 1
            where the devices compute at once, 1 or one per worker on CPU workers.
        refine: simulate near-optimal candidates and walk to faster neighbours
            ("pipeline" only).
        overlap_iterations: rank "fused" plans by the steady state of overlapped
            ``forward_backward(blocking=False)`` calls.
        concurrent: whether the devices compute at the same time (default: the pools
            say). Where not, the plan with the fewest stages memory allows is returned.

    Returns:
        One plan for one model, a list of plans (in order) for several.
    """
    rt = parse_kind(RunType, run_type, "run_type")
    if not models:
        raise ValueError("ModelExecutePlan.auto() needs at least one model to plan")
    check_flag(concurrent, "concurrent", none="the models' pools decide")
    profiles: list[LayerProfile] = []
    devices: list[int] = []
    capacities: list[int] = []
    overlap = len(models) == 1 and concurrent is None and _cpu_overlap(models[0])
    for i, m in enumerate(models):
        try:
            profiles.append(profile_of(m))
        except TypeError as exc:
            raise TypeError(f"model {i}: {exc}") from None
        if getattr(m, "num_devices", None) is not None:
            devices.append(int(m.num_devices))
        pool = getattr(m, "pool", None)
        for w in getattr(pool, "workers", ()) or ():
            capacities.append(int(w.memory_capacity()))
        if concurrent is None and pool is not None and not getattr(pool, "concurrent", True):
            concurrent = False
    if min_stages is None:
        if not devices:
            raise ValueError(
                "min_stages is needed when no RoundPipe model is given (it defaults to "
                "the number of devices)"
            )
        min_stages = max(devices)
    check_int(min_stages, "min_stages")
    if model_memory_limit is None:
        limit_bytes = DEFAULT_MEMORY_SHARE * min(capacities) if capacities else math.inf
    else:
        if not isinstance(model_memory_limit, (int, float)) or not model_memory_limit > 0:
            raise ValueError(
                f"model_memory_limit must be a positive number of GB, got {model_memory_limit!r}"
            )
        limit_bytes = float(model_memory_limit) * _GB
    # Half the limit per stage (the next one's parameters are prefetched), unless every
    # upload lends the host's parameters: nothing to prefetch.
    lending = all(bool(getattr(m, "uploads_lend_parameters", False)) for m in models)
    cap = _memory_cap(profiles, rt, limit_bytes, 1 if lending else 2)
    num_devices = max(devices) if devices else min_stages
    if num_microbatch is None:
        replicas = num_devices if len(models) == 1 and may_replicate(models[0]) else 1
        num_microbatch = default_num_microbatch(num_devices, concurrent is not False, replicas)
    if concurrent is False:
        fewest = fewest_stage_plans(rt, profiles, cap)
        if overlap and rt == RunType.FUSED and num_devices == 2:
            return _split_or_fewest(fewest[0], profiles[0], num_microbatch, replicable(models[0]))
        return fewest[0] if len(models) == 1 else fewest
    result = search_plans(
        rt,
        profiles,
        min_stages,
        cap,
        method=method,
        upper_threshold=upper_threshold,
        objective=objective,
        num_devices=num_devices,
        num_microbatch=num_microbatch,
        refine=refine and objective == "pipeline" and method == "exact",
        overlap_iterations=overlap_iterations,
    )
    return result.plans[0] if len(models) == 1 else result.plans


def _cpu_overlap(model: Any) -> bool:
    """Whether ``model``'s CPU workers compute stages side by side
    (``pool.cpu_stages_overlap``) and none of its stages was seen to draw random numbers."""
    layers = _overlapping_workers(model, "cpu_stages_overlap")
    return layers is not None and not model.pool.stages_draw(layers)


def _overlapping_workers(model: Any, overlap: str = "cpu_overlap") -> Any:
    """``model``'s layers where its pool's ``overlap`` flag holds, else ``None``."""
    pool = getattr(model, "pool", None)
    layers = getattr(model, "layers", None)
    return layers if pool is not None and getattr(pool, overlap, False) else None


def may_replicate(model: Any) -> bool:
    """Whether ``model``'s one-stage fused plan may run as one job per CPU worker, from its
    structure alone (fixed for its life): its workers overlap (``pool.cpu_overlap``) and
    no layer has buffers (replicas would update BatchNorm statistics out of order)."""
    layers = _overlapping_workers(model)
    return layers is not None and not any(True for layer in layers for _ in layer.buffers())


def replicable(model: Any) -> bool:
    """:func:`may_replicate`, and no stage was seen to draw random numbers."""
    return may_replicate(model) and not model.pool.stages_draw(model.layers)


def fused_replicas(model: Any, plan: ModelExecutePlan, num_microbatch: int) -> int:
    """How many jobs at once a "fused" call of ``plan`` runs its stage as: 1, or
    :func:`most_fused_replicas` where ``pool.stage_shares_cores`` allows."""
    workers = most_fused_replicas(model, plan, num_microbatch)
    if workers == 1:
        return 1
    r = plan.bwd_plan[0]
    return workers if model.pool.stage_shares_cores(model.layers, "fused", r.start, r.stop) else 1


def most_fused_replicas(model: Any, plan: ModelExecutePlan, num_microbatch: int) -> int:
    """The most jobs at once a "fused" call of ``plan`` may run its stage as: one per CPU
    worker for a one-stage plan, two or more microbatches and :func:`replicable`; else 1."""
    if plan.fwd_plan or len(plan.bwd_plan) != 1 or num_microbatch < 2:
        return 1
    workers = int(getattr(model, "num_devices", 1) or 1)
    return workers if workers > 1 and replicable(model) else 1


def split_plan(num_layers: int, split: int) -> ModelExecutePlan:
    """Forward ``[0, split)``, the fused stage ``[split, L)``, then the backward of
    ``[0, split)``: a plan for two overlapping CPU workers."""
    return ModelExecutePlan([range(0, split)], [range(split, num_layers), range(0, split)])


def _split_or_fewest(
    fewest: ModelExecutePlan,
    profile: LayerProfile,
    num_microbatch: int,
    replicated: bool = False,
) -> ModelExecutePlan:
    """On two overlapping CPU workers: the fastest of the one-stage plan and every
    :func:`split_plan` (the one-stage plan on ties, or when memory forces several)."""
    n = profile.num_layers
    if fewest.fwd_plan or len(fewest.bwd_plan) != 1 or n < 2:
        return fewest

    def ms_of(plan: ModelExecutePlan, replicated: bool = False) -> float:
        return simulated_iteration_ms(
            plan,
            profile,
            RunType.FUSED,
            2,
            num_microbatch,
            shared_cores=True,
            replicated=replicated,
        )

    best, best_ms = fewest, ms_of(fewest, replicated)
    for cand in (split_plan(n, split) for split in range(1, n)):
        if (ms := ms_of(cand)) < best_ms * (1 - 1e-9):
            best, best_ms = cand, ms
    return best


def _memory_cap(
    profiles: Sequence[LayerProfile], run_type: RunType, limit: float, parts: int
) -> float:
    """``limit / parts``, raised (with a warning) to the largest layer's need."""
    cap = limit / parts
    share = "model_memory_limit" if parts == 1 else f"model_memory_limit / {parts}"
    need, which = 0.0, (0, 0)
    for k, prof in enumerate(profiles):
        fmem, bmem = prof.stage_mem()
        per_layer = fmem if run_type == RunType.INFER else bmem
        big = max(range(len(per_layer)), key=per_layer.__getitem__)
        if per_layer[big] > cap and per_layer[big] > need:
            need, which = per_layer[big], (k, big)
    if need > cap:
        warnings.warn(
            f"layer {which[1]} of model {which[0]} needs {need / _GB:.3f} GB in one stage "
            "(parameters, gradients and one microbatch's saved activations), more than "
            f"{share} = {cap / _GB:.3f} GB; planning with a limit of "
            f"{parts * need / _GB:.3f} GB instead (raise model_memory_limit to silence this)",
            RuntimeWarning,
            stacklevel=4,  # the caller of ModelExecutePlan.auto
        )
        return need
    return cap


def predicted_speedup(
    current: ModelExecutePlan,
    candidate: ModelExecutePlan,
    model: Any,
    run_type: RunType | str,
    num_devices: int,
    num_microbatch: int,
    overlap_iterations: bool = False,
    concurrent: bool = True,
) -> float:
    """Simulated iteration time of ``current`` over ``candidate`` on ``model``'s profile
    (> 1: the candidate is faster); ``concurrent=False``: devices compute one at a time."""
    rt = parse_kind(RunType, run_type, "run_type")
    prof = profile_of(model)
    for name, plan in (("current", current), ("candidate", candidate)):
        if not isinstance(plan, ModelExecutePlan):
            raise TypeError(f"{name} must be a ModelExecutePlan, got {type(plan).__name__}")
        plan.check_valid(prof.num_layers, rt, num_devices)
    # CPU workers that overlap: the device model their plans were chosen by (see auto)
    shared = not concurrent and rt == RunType.FUSED and _cpu_overlap(model)
    rep = shared and replicable(model)
    old, new = (
        simulated_iteration_ms(
            p, prof, rt, num_devices, num_microbatch, overlap_iterations, concurrent, shared, rep
        )
        for p in (current, candidate)
    )
    return old / new if new > 0 else (1.0 if old == 0 else math.inf)


@dataclass(frozen=True)
class ReplanDecision:
    """The re-plan policy's verdict: take ``candidate`` over ``old`` only when predicted
    at least ``min_gain`` (0.05: 5 %) faster (``gain``): near-equal plans trade places
    with noisy timings, and the threshold keeps the plan in use then."""

    old: ModelExecutePlan
    candidate: ModelExecutePlan
    gain: float
    min_gain: float

    @property
    def changed(self) -> bool:
        """Whether the candidate replaces the plan in use."""
        return self.candidate != self.old and self.gain >= 1.0 + self.min_gain

    @property
    def plan(self) -> ModelExecutePlan:
        """The plan to run from now on."""
        return self.candidate if self.changed else self.old


def decide_replan(
    old: ModelExecutePlan,
    candidate: ModelExecutePlan,
    model: Any,
    run_type: RunType | str,
    num_devices: int,
    num_microbatch: int,
    min_gain: float,
    concurrent: bool = True,
) -> ReplanDecision:
    """The engine's one re-plan policy (the default plan's re-plan and ``AutoReplan``):
    see :class:`ReplanDecision`."""
    gain = 1.0
    if candidate != old:
        gain = predicted_speedup(
            old, candidate, model, run_type, num_devices, num_microbatch, concurrent=concurrent
        )
    return ReplanDecision(old, candidate, gain, float(min_gain))
