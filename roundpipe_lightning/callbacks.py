"""Callbacks around RoundPipe's layer timer: re-planning and stage-time logging."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from roundpipe_core import ModelExecutePlan
from roundpipe_core.kinds import check_int
from roundpipe_core.planning.simulate import simulate
from roundpipe_core.running.trace import (
    side_by_side_trace,
    spans_from_roundpipe,
    spans_from_simulation,
    write_trace,
)

from ._private import lightning_log_step
from .strategy import RoundPipeStrategy

__all__ = ["AutoReplan", "StageTimeLogger"]


def trace_file_name(step: int) -> str:
    """Zero-padded, so names sort in step order."""
    return f"step_{step:08d}.json"


def _strategy_of(trainer: Trainer, who: str) -> RoundPipeStrategy:
    strategy = trainer.strategy
    if not isinstance(strategy, RoundPipeStrategy):
        raise TypeError(
            f"{who} needs Trainer(strategy=RoundPipeStrategy(...)); this Trainer uses "
            f"{type(strategy).__name__}"
        )
    return strategy


class AutoReplan(Callback):
    """Re-plan the stage partition from measured layer times.

    After ``warmup_steps`` optimizer steps (then every ``every_n_steps`` if given) it
    runs ``ModelExecutePlan.auto(run_type, roundpipe, **auto_kwargs)`` on the layer
    timer's moving averages and installs the result for ``run_type`` calls. Each re-plan
    is logged at its step as the text ``roundpipe/plan_<run_type>`` (TensorBoard) and
    the scalars ``roundpipe/plan_fwd_stages`` / ``roundpipe/plan_bwd_stages`` and
    ``roundpipe/plan_changed`` (1.0 or 0.0); the plan is saved in checkpoints and
    re-installed on resume.

    Timings are noisy, so a new plan is installed only when the simulator predicts it
    at least ``min_gain`` faster than the plan in use; the log line says why, with the
    predicted gain.

    Args:
        warmup_steps: optimizer steps measured before the first re-plan.
        every_n_steps: re-plan again every this many steps after the first; None: once.
        run_type: "fused" (``forward_backward``), "train" (``roundpipe(x)`` + backward)
            or "infer".
        min_gain: the predicted speed-up (0.05: 5 %) a new plan must bring.
        **auto_kwargs: passed to ``ModelExecutePlan.auto`` (``min_stages``, ...).
    """

    def __init__(
        self,
        warmup_steps: int = 5,
        every_n_steps: int | None = None,
        run_type: str = "fused",
        min_gain: float = 0.05,
        **auto_kwargs: Any,
    ) -> None:
        check_int(warmup_steps, "warmup_steps")
        if every_n_steps is not None:
            check_int(every_n_steps, "every_n_steps", why="or None")
        if run_type not in ("infer", "train", "fused"):
            raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
        if (
            not isinstance(min_gain, (int, float))
            or isinstance(min_gain, bool)
            or not 0 <= min_gain < 10
        ):
            raise ValueError(f"min_gain must be a number in [0, 10) (0.05 = 5 %), got {min_gain!r}")
        self.min_gain = float(min_gain)
        self.last_predicted_gain: float | None = None
        self.warmup_steps = warmup_steps
        self.every_n_steps = every_n_steps
        self.run_type = run_type
        self.auto_kwargs = auto_kwargs
        self.plan: ModelExecutePlan | None = None
        self.last_replan_step: int | None = None
        self.history: list[tuple[int, ModelExecutePlan]] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _strategy_of(trainer, "AutoReplan")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.plan is not None:
            try:
                _strategy_of(trainer, "AutoReplan").roundpipe.set_plan(self.run_type, self.plan)
            except ValueError as exc:
                raise ValueError(
                    f"AutoReplan: the plan restored from the checkpoint ({self.plan}) does not "
                    f"fit this run: {exc}. Resume on the devices and with the model the "
                    "checkpoint was saved with, or drop the restored plan (delete AutoReplan's "
                    "entry under checkpoint['callbacks']) to plan afresh"
                ) from exc

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
        rp = _strategy_of(trainer, "AutoReplan").roundpipe
        if not rp.model_timer.has_measurements():
            return  # nothing measured yet (e.g. the training step never ran the pipeline)
        self.replan(trainer, rp, step)

    def replan(self, trainer: Trainer, rp: Any, step: int) -> ModelExecutePlan:
        """Plan from the timer now, install, log and return the plan."""
        decision = rp.replan(self.run_type, self.min_gain, **self.auto_kwargs)
        old, candidate, gain, plan = decision.old, decision.candidate, decision.gain, decision.plan
        self.last_predicted_gain = gain
        self.plan, self.last_replan_step = plan, step
        self.history.append((step, plan))
        text = plan.to_layout_string()
        if decision.changed:
            why = f"new {self.run_type} plan {text} (was {old.to_layout_string()}): predicted {gain:.3f}x"
        elif candidate == old:
            why = f"kept {self.run_type} plan {text}: the planner chose it again"
        else:
            why = (
                f"kept {self.run_type} plan {text}: the best alternative {candidate.to_layout_string()} "
                f"is predicted {gain:.3f}x, below the {1.0 + self.min_gain:.3f}x threshold (min_gain)"
            )
        rank_zero_info(f"AutoReplan (step {step}): {why}")
        metrics = {
            "roundpipe/plan_fwd_stages": float(len(plan.fwd_plan)),
            "roundpipe/plan_bwd_stages": float(len(plan.bwd_plan)),
            "roundpipe/plan_changed": float(decision.changed),
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
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "last_replan_step": self.last_replan_step,
            "run_type": self.run_type,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        def invalid(what: str) -> ValueError:
            return ValueError(
                f"AutoReplan: the checkpoint's AutoReplan state is not valid ({what}); it was "
                "not written by AutoReplan.state_dict(). Delete AutoReplan's entry under "
                "checkpoint['callbacks'] to resume and plan afresh"
            )

        if not isinstance(state_dict, Mapping):
            raise invalid(f"a {type(state_dict).__name__}, not a dict")
        if state_dict.get("run_type", self.run_type) != self.run_type:
            return  # a plan for another kind of call
        plan, step = state_dict.get("plan"), state_dict.get("last_replan_step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise invalid(f"last_replan_step={step!r}")
        try:
            self.plan = ModelExecutePlan.from_dict(plan) if plan is not None else None
        except (TypeError, ValueError) as exc:
            raise invalid(f"plan={plan!r}: {exc}") from exc
        self.last_replan_step = step


class StageTimeLogger(Callback):
    """Log RoundPipe's timings through ``trainer.loggers`` (TensorBoard by default).

    It logs where Lightning logs its own metrics (``(step + 1) % every_n_steps == 0``,
    at Lightning's logging step, and where ``trainer.should_stop`` ends training).
    Under ``roundpipe/``:

    * ``layer_XX/fwd_ms``, ``layer_XX/re_ms``, ``layer_XX/bwd_ms``: the layer timer's
      moving averages for one microbatch (``log_layers=False`` turns them off);
    * ``stage/<kind><stage>_ms``: busy time of each job of the last pipelined call
      (``fused0``, ``backward2``, ...; a stage run as several jobs adds them up);
    * ``device_D/busy_ms``: busy time of device ``D`` in that call;
    * ``call_ms``: the call's wall time (``RoundPipe.last_call.wall_ms``);
    * ``bubble_ratio``: ``1 - sum(busy) / (call_ms x devices)``;
    * ``sim_iteration_ms`` / ``sim_bubble_ratio``: the same plan simulated with the
      timer's estimates, on the scale of ``call_ms`` (far below it: time goes to what
      the estimates do not hold, such as transfers or a loaded host);
    * ``step_ms``: the training step's wall time, with ``samples_per_s`` and, for
      token-id inputs, ``tokens_per_s``;
    * the image ``roundpipe/timeline`` (TensorBoard, needs matplotlib): the last call
      measured above its simulation (:func:`roundpipe_lightning.timeline.render_timeline`).

    With ``trace_dir`` it also writes ``trace_dir/step_<step>.json`` (``step_00000009.json``)
    at each logging step: the measured call and its simulation side by side as Chrome
    trace-event JSON (open in https://ui.perfetto.dev).

    Args:
        every_n_steps: logging interval in optimizer steps (default: the Trainer's
            ``log_every_n_steps``).
        log_layers: also log the per-layer estimates.
        trace_dir: folder for the trace files; ``None`` writes none.
        log_timeline: log the ``roundpipe/timeline`` image to TensorBoard loggers.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        log_layers: bool = True,
        trace_dir: str | Path | None = None,
        log_timeline: bool = True,
    ) -> None:
        if every_n_steps is not None:
            check_int(every_n_steps, "every_n_steps", why="or None")
        if trace_dir is not None and not isinstance(trace_dir, (str, Path)):
            raise TypeError(
                f"trace_dir must be a folder path (str or Path) or None, got {type(trace_dir).__name__}"
            )
        self.every_n_steps = every_n_steps
        self.log_layers = log_layers
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.log_timeline = log_timeline
        self._t0: float | None = None
        self._global_step_at_start = 0
        self._last_step: int | None = None
        self.last_metrics: dict[str, float] = {}
        self.last_image: np.ndarray | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _strategy_of(trainer, "StageTimeLogger")

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._t0 = time.perf_counter()
        self._global_step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_ms = (time.perf_counter() - self._t0) * 1000.0 if self._t0 is not None else 0.0
        # with gradient accumulation only the batch that stepped the optimizer logs
        if trainer.global_step == self._global_step_at_start or not trainer.loggers:
            return
        every = self.every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        step = lightning_log_step(trainer)
        # Lightning also logs the batch after which training stops (early stopping)
        due = every >= 1 and ((step + 1) % every == 0 or trainer.should_stop)
        if not due or step == self._last_step:
            return
        self._last_step = step
        rp = _strategy_of(trainer, "StageTimeLogger").roundpipe
        sim = self._simulate(rp)
        metrics = self.collect(rp, step_ms, sim)
        self.last_metrics = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        measured = spans_from_roundpipe(rp)
        simulated = spans_from_simulation(sim, iteration=-1) if sim is not None else None
        if self.trace_dir is not None and measured:
            path = self.trace_dir / trace_file_name(step)
            write_trace(path, side_by_side_trace(measured, simulated))
        tensorboards = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if self.log_timeline and tensorboards and measured:
            try:
                from .timeline import render_timeline

                image = render_timeline(measured, simulated, title=f"step {step}")
            except ImportError:
                rank_zero_info("StageTimeLogger: pip install matplotlib to log roundpipe/timeline")
                self.log_timeline = False  # say it once
                return
            self.last_image = image
            for lg in tensorboards:
                lg.experiment.add_image("roundpipe/timeline", image, step, dataformats="HWC")

    def collect(self, rp: Any, step_ms: float, sim: Any = None) -> dict[str, float]:
        """The metrics of ``rp``'s last call (the class docstring); ``sim``: its simulation."""
        m: dict[str, float] = {}
        timer = rp.model_timer
        if self.log_layers:
            for kind, values in (("fwd", timer.fwd_ms), ("re", timer.re_ms), ("bwd", timer.bwd_ms)):
                for i, v in enumerate(values):
                    m[f"roundpipe/layer_{i:02d}/{kind}_ms"] = float(v)
        call = rp.last_call
        stage_ms: dict[str, float] = defaultdict(float)
        for t in call.jobs:
            stage_ms[f"roundpipe/stage/{t.job.kind}{t.job.stage}_ms"] += t.busy_ms
        m.update(stage_ms)
        for d, b in enumerate(call.device_busy_ms(rp.num_devices)):
            m[f"roundpipe/device_{d}/busy_ms"] = b
        bubble = call.bubble_ratio(rp.num_devices)
        if bubble is not None:
            m["roundpipe/call_ms"] = call.wall_ms
            m["roundpipe/bubble_ratio"] = bubble
        if sim is not None:
            m["roundpipe/sim_iteration_ms"] = float(sim.makespan_ms)
            m["roundpipe/sim_bubble_ratio"] = float(sim.bubble_ratio)
        if step_ms > 0:
            m["roundpipe/step_ms"] = step_ms
            if call.samples:
                m["roundpipe/samples_per_s"] = call.samples / (step_ms / 1000.0)
            if call.tokens:
                m["roundpipe/tokens_per_s"] = call.tokens / (step_ms / 1000.0)
        return m

    @staticmethod
    def _simulate(rp: Any) -> Any:
        """One iteration of the last call's plan on the timer's per-microbatch estimates."""
        jobs = rp.last_call.schedule
        if not jobs:
            return None
        kinds = {j.kind for j in jobs}
        run_type = "fused" if "fused" in kinds else ("train" if "backward" in kinds else "infer")
        if run_type == "train":
            return None  # forward and backward phases ran as separate calls
        # the call's microbatches (a stage run as several jobs at once splits them)
        mbs = max(j.microbatches.stop for j in jobs)
        # the plan that ran (the default may have been re-planned since; a stage run as
        # several jobs, ``Job.replicas``, is one)
        first = [j for j in jobs if j.replica == 0]
        fwd = sorted((j for j in first if j.kind == "forward"), key=lambda j: j.stage)
        bwd = sorted((j for j in first if j.kind != "forward"), key=lambda j: j.stage)
        timer = rp.model_timer
        try:
            return simulate(
                ModelExecutePlan([j.layers for j in fwd], [j.layers for j in bwd]),
                timer.fwd_ms,
                timer.bwd_ms,
                rp.num_devices,
                mbs,
                run_type=run_type,
                re_ms=timer.re_ms,
                # CPU workers compute one at a time: simulated as they run
                concurrent=rp.pool.concurrent,
            )
        except ValueError:
            return None
