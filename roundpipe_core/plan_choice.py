"""Which plan a call of a ``RoundPipe`` runs (:class:`PlanChoice`, held as ``rp.plans``):
the plans set with ``set_plan``, the configured plan, or the default plan the planner
makes and re-makes once measured timings have settled; and the activation bytes the
planner's memory cap counts. It reads the run configuration, pool, timer and plan-fit
checker, which the pure ``planning/`` wing may not import.
"""

from __future__ import annotations

from typing import Any

from . import batch as batching
from .checks import PlanFitChecker
from .config import RoundPipeRunConfig
from .kinds import RunType, parse_kind
from .planning.plan import ModelExecutePlan, default_num_microbatch
from .planning.planner import ReplanDecision, decide_replan, may_replicate
from .planning.profile import profile_of

__all__ = ["PlanChoice"]


class PlanChoice:
    """The plans of one RoundPipe ``model`` (see the module docstring).

    It plans for ``model`` itself (``ModelExecutePlan.auto(run_type, model)`` reads its
    layers, pool, timer and activation bytes) and reads ``model.model_run_config`` at
    every call, so a run configuration assigned later counts.
    """

    #: Measured iterations the timer's averages need before the default plan is re-planned.
    DEFAULT_REPLAN_AFTER = 3
    #: Predicted speed-up a re-planned default plan needs to replace the first one.
    DEFAULT_REPLAN_MIN_GAIN = 0.05

    def __init__(self, model: Any) -> None:
        self.model = model
        self.fits = PlanFitChecker(model.layers)
        # (run type, microbatches) -> (plan, made from settled timings)
        self._defaults: dict[tuple[RunType, int], tuple[ModelExecutePlan, bool]] = {}
        self._chosen: dict[RunType, ModelExecutePlan] = {}  # set_plan's

    def set_plan(self, run_type: RunType | str, plan: ModelExecutePlan | None) -> None:
        """``RoundPipe.set_plan``."""
        rt = parse_kind(RunType, run_type, "run_type")
        if plan is None:
            self._chosen.pop(rt, None)
            return
        if not isinstance(plan, ModelExecutePlan):
            raise TypeError(f"plan must be a ModelExecutePlan or None, got {type(plan).__name__}")
        plan.check_valid(self.model.num_layers, rt, self.model.num_devices)
        self._chosen[rt] = plan

    def plan_for(
        self,
        run_type: RunType | str,
        run_config: RoundPipeRunConfig | None = None,
        num_microbatch: int | None = None,
    ) -> ModelExecutePlan:
        """``RoundPipe.plan_for``; ``num_microbatch``: the microbatches a default plan is
        made for (default: the call's, else the model's)."""
        rt = parse_kind(RunType, run_type, "run_type")
        if run_config is not None and run_config.execute_plan is not None:
            return run_config.execute_plan
        plan = self._chosen.get(rt)
        if plan is not None:
            return plan
        config = self.model.model_run_config
        if config.execute_plan is not None:
            return config.execute_plan
        m = num_microbatch or (run_config.num_microbatch if run_config is not None else None)
        return self.default_plan(rt, m or config.num_microbatch)

    def choose(
        self,
        run_config: RoundPipeRunConfig | None,
        run_type: RunType,
        cfg: RoundPipeRunConfig,
        split: batching.SplitInputs,
    ) -> ModelExecutePlan:
        """The plan a call runs; a default plan is made for the microbatches the batch
        gives (a batch of 6 cannot make the 10**6 microbatches asked for: nor plan them).
        A plan the user chose is checked against the smallest device's memory."""
        model = self.model
        n = len(split.parts)
        if run_type != RunType.INFER:
            # Before any plan is made: the automatic planner caps each stage for its
            # parameters, gradients and saved activations, so it needs the activations of
            # the first training call (measured once; only autograd stages save them).
            args, kwargs = split.parts[0]
            known = self.fits.activation_bytes is not None
            self.fits.measure(args, kwargs, split.sizes[0] if split.sizes else 0)
            if not known and self.fits.activation_bytes is not None:
                self._forget_training_plans()
        asked = self.num_microbatch_for(cfg.num_microbatch)
        plan = self.plan_for(run_type, run_config, n if n < asked else None)
        plan.check_valid(model.num_layers, run_type, model.num_devices)
        manual = (
            (run_config is not None and run_config.execute_plan is not None)
            or run_type in self._chosen
            or model.model_run_config.execute_plan is not None
        )
        if manual:
            self.fits.check(plan, run_type, lambda: profile_of(model), model.pool.memory_capacity)
        return plan

    def set_activation_bytes(self, value: list[float] | None) -> None:
        """``RoundPipe.layer_activation_bytes = value``."""
        self.fits.set_activation_bytes(value)
        self._forget_training_plans()

    def _forget_training_plans(self) -> None:
        """Drop the default training plans made without the activations known now."""
        for key in [k for k in self._defaults if k[0] != RunType.INFER]:
            del self._defaults[key]

    def num_microbatch_for(self, num_microbatch: int | None = None) -> int:
        """``RoundPipe.num_microbatch_for``."""
        given = num_microbatch or self.model.model_run_config.num_microbatch
        if given:
            return given
        n = self.model.num_devices
        replicas = n if may_replicate(self.model) else 1
        return default_num_microbatch(n, self.model.pool.concurrent, replicas)

    def default_plan(
        self, run_type: RunType | str, num_microbatch: int | None = None
    ) -> ModelExecutePlan:
        """``RoundPipe.default_plan``."""
        model = self.model
        rt = parse_kind(RunType, run_type, "run_type")
        m = self.num_microbatch_for(num_microbatch)
        settled = model.model_timer.measured_iterations() >= self.DEFAULT_REPLAN_AFTER
        key = (rt, m)
        cached = self._defaults.get(key)
        if cached is not None and (cached[1] or not settled):
            return cached[0]
        plan = ModelExecutePlan.auto(rt, model, num_microbatch=m)
        assert isinstance(plan, ModelExecutePlan)  # one model in, one plan out
        if cached is not None:
            plan = decide_replan(
                cached[0],
                plan,
                model,
                rt,
                model.num_devices,
                m,
                self.DEFAULT_REPLAN_MIN_GAIN,
                concurrent=model.pool.concurrent,
            ).plan
        self._defaults[key] = (plan, settled)
        return plan

    def replan(
        self, run_type: RunType | str, min_gain: float | None = None, **auto_kwargs: Any
    ) -> ReplanDecision:
        """``RoundPipe.replan``."""
        model = self.model
        rt = parse_kind(RunType, run_type, "run_type")
        gain = self.DEFAULT_REPLAN_MIN_GAIN if min_gain is None else min_gain
        m = self.num_microbatch_for(auto_kwargs.get("num_microbatch"))
        asked = auto_kwargs.get("concurrent")
        concurrent = model.pool.concurrent if asked is None else asked
        old = self.plan_for(rt)
        candidate = ModelExecutePlan.auto(
            rt, model, **{**auto_kwargs, "num_microbatch": m, "concurrent": concurrent}
        )
        assert isinstance(candidate, ModelExecutePlan)  # one model in, one plan out
        # the gain is simulated on the device model the candidate was planned for
        decision = decide_replan(
            old, candidate, model, rt, model.num_devices, m, gain, concurrent=concurrent
        )
        self.set_plan(rt, decision.plan)
        return decision
