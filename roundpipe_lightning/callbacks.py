"""Callbacks around RoundPipe's layer timer: re-planning and stage-time logging."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from roundpipe_core import ModelExecutePlan

from .plans import _one_plan, describe_plan

__all__ = ["AutoReplan", "StageTimeLogger", "FlushWeights"]


def _roundpipe_of(trainer: Trainer, who: str) -> Any:
    from .strategy import RoundPipeStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, RoundPipeStrategy):
        raise TypeError(
            f"{who} needs Trainer(strategy=RoundPipeStrategy(...)); this Trainer uses "
            f"{type(strategy).__name__}"
        )
    return strategy.roundpipe


def _check_strategy(trainer: Trainer, who: str) -> None:
    from .strategy import RoundPipeStrategy

    if not isinstance(trainer.strategy, RoundPipeStrategy):
        raise TypeError(
            f"{who} needs Trainer(strategy=RoundPipeStrategy(...)); this Trainer uses "
            f"{type(trainer.strategy).__name__}"
        )


def _plan_to_state(plan: ModelExecutePlan) -> dict[str, Any]:
    return {
        "fwd": [[r.start, r.stop] for r in plan.fwd_plan],
        "bwd": [[r.start, r.stop] for r in plan.bwd_plan],
        "fwd_owners": plan.fwd_owners,
        "bwd_owners": plan.bwd_owners,
    }


def _plan_from_state(state: dict[str, Any]) -> ModelExecutePlan:
    return ModelExecutePlan(
        [range(a, b) for a, b in state["fwd"]],
        [range(a, b) for a, b in state["bwd"]],
        state.get("fwd_owners"),
        state.get("bwd_owners"),
    )


class AutoReplan(Callback):
    """Re-plan the stage partition from measured layer times.

    After ``warmup_steps`` optimizer steps (and then every ``every_n_steps`` if
    given) it runs ``ModelExecutePlan.auto(run_type, roundpipe, **auto_kwargs)``
    on the layer timer's moving averages and installs the result for the
    strategy's ``run_type`` calls (``"fused"``: ``forward_backward``). Each new
    plan is logged as text (TensorBoard) and as the scalars
    ``roundpipe/plan_fwd_stages`` / ``roundpipe/plan_bwd_stages``; the installed
    plan is saved in checkpoints and re-installed on resume.

    Args:
        warmup_steps: optimizer steps measured before the first re-plan (the
            timer drops each layer's first measurement).
        every_n_steps: re-plan again every this many steps after the first; None: once.
        run_type: the kind of call to plan: "fused" (``forward_backward``),
            "train" (``roundpipe(x)`` + backward) or "infer".
        **auto_kwargs: passed to ``ModelExecutePlan.auto`` (``min_stages``,
            ``upper_threshold``, ``model_memory_limit``, ``method``).
    """

    def __init__(
        self,
        warmup_steps: int = 5,
        every_n_steps: int | None = None,
        run_type: str = "fused",
        **auto_kwargs: Any,
    ) -> None:
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1, got {warmup_steps!r}")
        if every_n_steps is not None and (
            not isinstance(every_n_steps, int)
            or isinstance(every_n_steps, bool)
            or every_n_steps < 1
        ):
            raise ValueError(f"every_n_steps must be an int >= 1 or None, got {every_n_steps!r}")
        if run_type not in ("infer", "train", "fused"):
            raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
        self.warmup_steps = warmup_steps
        self.every_n_steps = every_n_steps
        self.run_type = run_type
        self.auto_kwargs = auto_kwargs
        self.plan: ModelExecutePlan | None = None
        self.last_replan_step: int | None = None
        self.history: list[tuple[int, ModelExecutePlan]] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _check_strategy(trainer, "AutoReplan")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A plan restored from a checkpoint goes back into the new RoundPipe.
        if self.plan is not None:
            _roundpipe_of(trainer, "AutoReplan").set_plan(self.run_type, self.plan)

    def _due(self, step: int) -> bool:
        if self.last_replan_step is None:
            return step >= self.warmup_steps
        return self.every_n_steps is not None and step - self.last_replan_step >= self.every_n_steps

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not self._due(step):
            return
        rp = _roundpipe_of(trainer, "AutoReplan")
        if not rp.model_timer.has_measurements():
            return  # nothing measured yet (e.g. the training step never ran the pipeline)
        self.replan(trainer, rp, step)

    def replan(self, trainer: Trainer, rp: Any, step: int) -> ModelExecutePlan:
        """Plan from the timer now, install and log the plan; returns it."""
        old = rp.plan_for(self.run_type)
        plan = _one_plan(ModelExecutePlan.auto(self.run_type, rp, **self.auto_kwargs))
        rp.set_plan(self.run_type, plan)
        self.plan, self.last_replan_step = plan, step
        self.history.append((step, plan))
        text = describe_plan(plan)
        changed = plan != old
        rank_zero_info(
            f"AutoReplan (step {step}): {'new' if changed else 'unchanged'} {self.run_type} plan {text}"
            + (f" (was {describe_plan(old)})" if changed else "")
        )
        metrics = {
            "roundpipe/plan_fwd_stages": float(len(plan.fwd_plan)),
            "roundpipe/plan_bwd_stages": float(len(plan.bwd_plan)),
            "roundpipe/plan_changed": float(changed),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(
                    f"roundpipe/plan_{self.run_type}", text, global_step=step
                )
        return plan

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": _plan_to_state(self.plan) if self.plan is not None else None,
            "last_replan_step": self.last_replan_step,
            "run_type": self.run_type,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("run_type", self.run_type) != self.run_type:
            return  # a plan for another kind of call
        plan = state_dict.get("plan")
        self.plan = _plan_from_state(plan) if plan is not None else None
        self.last_replan_step = state_dict.get("last_replan_step")


class StageTimeLogger(Callback):
    """Log RoundPipe's timings through ``trainer.logger`` (TensorBoard by default).

    Every ``every_n_steps`` optimizer steps it logs, under ``roundpipe/``:

    * ``layer_XX/fwd_ms``, ``re_ms``, ``bwd_ms``: the layer timer's moving averages
      (all microbatches of one iteration; ``log_layers=False`` turns them off);
    * ``stage/<kind><index>_ms``: measured busy time of each job of the last
      pipelined call (``forward0``, ``fused0``, ``backward2``, ...);
    * ``device_D/busy_ms`` and ``bubble_ratio``: per-device busy time of the last
      call and ``1 - sum(busy) / (call wall time x devices)``;
    * ``sim_iteration_ms`` / ``sim_bubble_ratio``: the same plan simulated with
      the timer's estimates (``roundpipe_core.simulate``);
    * ``step_ms``, ``samples_per_s`` and, for token-id inputs, ``tokens_per_s``.

    Args:
        every_n_steps: logging interval in optimizer steps (default: the Trainer's
            ``log_every_n_steps``).
        log_layers: also log the per-layer estimates.
    """

    def __init__(self, every_n_steps: int | None = None, log_layers: bool = True) -> None:
        if every_n_steps is not None and (
            not isinstance(every_n_steps, int)
            or isinstance(every_n_steps, bool)
            or every_n_steps < 1
        ):
            raise ValueError(f"every_n_steps must be an int >= 1 or None, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.log_layers = log_layers
        self._t0: float | None = None
        self._last_step: int | None = None
        self.last_metrics: dict[str, float] = {}

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _check_strategy(trainer, "StageTimeLogger")

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_ms = (time.perf_counter() - self._t0) * 1000.0 if self._t0 is not None else 0.0
        every = self.every_n_steps or max(1, trainer.log_every_n_steps)  # type: ignore[attr-defined]
        step = trainer.global_step
        # with gradient accumulation several batches end at the same global step: log once
        if step == 0 or step % every != 0 or step == self._last_step or not trainer.loggers:
            return
        self._last_step = step
        rp = _roundpipe_of(trainer, "StageTimeLogger")
        metrics = self.collect(rp, step_ms)
        self.last_metrics = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def collect(self, rp: Any, step_ms: float) -> dict[str, float]:
        """The metrics of the last pipelined call of ``rp`` (see the class docstring)."""
        m: dict[str, float] = {}
        timer = rp.model_timer
        if self.log_layers:
            for kind, values in (("fwd", timer.fwd_ms), ("re", timer.re_ms), ("bwd", timer.bwd_ms)):
                for i, v in enumerate(values):
                    m[f"roundpipe/layer_{i:02d}/{kind}_ms"] = float(v)
        busy = [0.0] * rp.num_devices
        stage_ms: dict[str, float] = defaultdict(float)
        for job, device, ms in rp.last_job_times:
            stage_ms[f"roundpipe/stage/{job.kind}{job.stage}_ms"] += float(ms)
            busy[device] += float(ms)
        m.update(stage_ms)
        for d, b in enumerate(busy):
            m[f"roundpipe/device_{d}/busy_ms"] = b
        wall = float(rp.last_call_ms)
        if wall > 0 and rp.last_job_times:
            m["roundpipe/call_ms"] = wall
            m["roundpipe/bubble_ratio"] = max(0.0, 1.0 - sum(busy) / (wall * rp.num_devices))
        sim = self._simulate(rp)
        if sim is not None:
            m["roundpipe/sim_iteration_ms"] = sim.makespan_ms
            m["roundpipe/sim_bubble_ratio"] = sim.bubble_ratio
        if step_ms > 0:
            m["roundpipe/step_ms"] = step_ms
            samples, tokens = rp.last_call_samples, rp.last_call_tokens
            if samples:
                m["roundpipe/samples_per_s"] = samples / (step_ms / 1000.0)
            if tokens:
                m["roundpipe/tokens_per_s"] = tokens / (step_ms / 1000.0)
        return m

    @staticmethod
    def _simulate(rp: Any) -> Any:
        """Simulate the last call's plan with the timer's per-microbatch estimates."""
        jobs = rp.last_schedule
        if not jobs:
            return None
        from roundpipe_core.simulate import simulate

        kinds = {j.kind for j in jobs}
        run_type = "fused" if "fused" in kinds else ("train" if "backward" in kinds else "infer")
        if run_type == "train":
            return None  # forward and backward phases ran as separate calls
        mbs = len(jobs[0].microbatches)
        timer = rp.model_timer
        plan = rp.plan_for(run_type)
        try:
            return simulate(
                plan,
                [x / mbs for x in timer.fwd_ms],
                [x / mbs for x in timer.bwd_ms],
                rp.num_devices,
                mbs,
                run_type=run_type,
                re_ms=[x / mbs for x in timer.re_ms],
            )
        except ValueError:
            return None


class FlushWeights(Callback):
    """Calls ``flush`` (the strategy's: finish the queued optimizer step and copy its
    weights into the module) before each hook where users read weights.

    RoundPipeStrategy with ``async_step=True`` puts it first in ``trainer.callbacks``:
    callback hooks run before the LightningModule's and the strategy's own, so every
    user callback and module hook then sees the weights of every step taken so far.
    """

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._flush()
