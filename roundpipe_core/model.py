"""RoundPipe: the pipelined calls of an ``nn.Sequential`` whose state stays on the host.

Each call splits the batch into microbatches, builds the iteration's schedule
(``schedule.py``) and runs it on the device pool (``runtime.py``); gradients land in the
master copies. The masters, the step and ``synchronize`` are
:class:`~roundpipe_core.base.RoundPipeBase`'s, the plans
:class:`~roundpipe_core.plan_choice.PlanChoice`'s.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import batch as batching
from .autograd import AutogradForward
from .base import RoundPipeBase
from .batch.tree import batch_extent
from .checks import (
    ForwardRuleChecker,
    check_inputs_need_no_grad,
    check_not_compiled_in_place,
)
from .config import RoundPipeRunConfig, check_run_config
from .kinds import PinMode, RecomputeGrain, RunType, check_flag, parse_kind
from .loss import check_loss_reduction, default_loss_fn, microbatch_loss_weights
from .plan_choice import PlanChoice
from .planning.plan import ModelExecutePlan
from .planning.planner import ReplanDecision, fused_replicas
from .planning.schedule import Job, boundary_layers, build_schedule, jobs_by_device
from .running.runtime import PipelineRun, run_queue
from .running.timer import CallTiming, ModelTimer
from .stepping.layerwise import GradCompletion
from .stepping.pipelined import (
    GradBuffer,
    PendingResult,
    RunFinisher,
    to_output_device,
)

__all__ = ["RoundPipe"]


class RoundPipe(RoundPipeBase):
    """Train or run an ``nn.Sequential`` whose state lives in host memory on a pool of devices.

    Args:
        model: an ``nn.Sequential`` (each child is a layer) or any module (one layer),
            wrapped in place: after ``synchronize()`` its parameters hold the trained values.
        optim_dtype: dtype of the master copies the optimizer updates (default: the
            model's; typically ``torch.float32`` for a bf16/fp16 model).
        name: a name for logs.
        model_run_config: default ``RoundPipeRunConfig`` of this model's calls.
        pin_model: host memory of the parameters on CUDA: "alloc" (pinned copies),
            "register" (pin the existing storage) or "off" (pageable); ignored on CPU.
        devices: ``None`` (all GPUs, else ``ROUNDPIPE_CPU_DEVICES`` CPU workers, default 2),
            an int, ``"cpu:N"``, a list of devices, or the ``DevicePool`` of another RoundPipe.
        original_model: the object attribute lookups fall through to (default ``model``;
            a preset passes the Hugging Face model it converted).
        master_owner: another RoundPipe whose masters cover this model's parameters (an
            automatic split's inner units): this one accumulates into the owner's.
        shared_masters: ``True``: a trainable parameter that already has ``optim_dtype``
            is its own master -- one tensor instead of two (4 B/param less for fp32), the
            optimizer updates the module's weights in place (others still get copies).
            Every ``step()`` is then synchronous (``is_async=True`` runs as ``False``,
            with a warning), with plain PyTorch's numbers. ``None`` (default): ``True``
            on CPU workers, ``False`` on GPUs (``DevicePool.concurrent``).
        loss_reduction: how ``forward_backward`` combines its per-microbatch losses:
            ``"sum"`` (default, the published contract) or ``"mean"`` (each weighted by
            its share of the batch rows: a ``loss_fn`` returning a batch mean gives the
            whole batch's mean). Also a settable attribute; a call's argument wins.
        offload_dir: a directory for the disk tier: the fp32 masters and the optimizer
            state live in files there, streamed by ``step_layerwise(functools.partial(
            step_subset, opt), finish=opt.zero_grad)`` (``step()`` raises ValueError).
            Needs ``shared_masters`` False or None. See ``docs/host-memory.md``.

    Attributes:
        loss_multiplier: ``None`` or a callable read once per ``forward_backward`` (in the
            caller's thread): each microbatch loss is multiplied by its value before its
            backward; the call still returns the unmultiplied loss.
        forward_backward_hook: ``None`` or ``hook(call, kwargs)``, run in the caller's thread
            around each ``forward_backward``; ``call(**kwargs)`` is the engine's own, and
            ``kwargs["blocking"]`` is ``None`` unless the caller chose.
        last_call: the :class:`~roundpipe_core.running.timer.CallTiming` of the last
            pipelined call: its schedule, each job's device, span and busy time, the
            transfers waited on, its wall time and batch size.
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        pin_model: PinMode | str = PinMode.ALLOC,
        devices: Any = None,
        original_model: Any = None,
        master_owner: RoundPipeBase | None = None,
        shared_masters: bool | None = None,
        loss_reduction: str = "sum",
        offload_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        model_run_config = check_run_config(
            model_run_config if model_run_config is not None else RoundPipeRunConfig(),
            "model_run_config",
        )
        super().__init__(
            model,
            optim_dtype=optim_dtype,
            name=name,
            pin_model=pin_model,
            devices=devices,
            original_model=original_model,
            master_owner=master_owner,
            shared_masters=shared_masters,
            offload_dir=offload_dir,
        )
        self.model_run_config = model_run_config
        self.loss_reduction = check_loss_reduction(loss_reduction)
        self.model_timer = ModelTimer(self.layers)
        self._rule_checker = ForwardRuleChecker(self.layers, self.pool.unreplayed_host_draws)
        self._timer_lock = threading.Lock()
        self.plans = PlanChoice(self)  # which plan each call runs
        self._seed_calls = 0  # pipelined calls so far: each gets its own random streams
        self.last_call = CallTiming()
        self.loss_multiplier: Callable[[], float] | None = None
        self.forward_backward_hook: Callable[[Callable[..., Any], dict[str, Any]], Any] | None = (
            None
        )
        self._seal()

    def __repr__(self) -> str:
        return f"RoundPipe(name={self.name!r}, layers={self.num_layers}, devices={self.pool!r})"

    # -- plans (held by self.plans) ----------------------------------------------------------
    def set_plan(self, run_type: RunType | str, plan: ModelExecutePlan | None) -> None:
        """Use ``plan`` for the calls of ``run_type`` ("infer", "train", "fused") that do
        not pass their own ``execute_plan``; ``None`` returns that run type to the model's
        default plan.

        Raises:
            TypeError: ``plan`` is not a ``ModelExecutePlan``.
            ValueError: ``run_type`` is unknown, or ``plan`` is not valid for this model,
                run type and device pool.
        """
        self.plans.set_plan(run_type, plan)

    def plan_for(
        self, run_type: RunType | str, run_config: RoundPipeRunConfig | None = None
    ) -> ModelExecutePlan:
        """The plan a call of ``run_type`` with ``run_config`` runs.

        Precedence: ``run_config.execute_plan``, then the plan given to ``set_plan``,
        then ``model_run_config.execute_plan``, then ``default_plan``.
        """
        return self.plans.plan_for(run_type, run_config)

    def num_microbatch_for(self, num_microbatch: int | None = None) -> int:
        """Microbatches a call runs: ``num_microbatch`` if given, else the model's
        ``model_run_config.num_microbatch``, else the default for this pool
        (:func:`~roundpipe_core.planning.plan.default_num_microbatch`: devices + 1 on
        devices that compute at once; on CPU workers 1, or one per worker where their
        one-stage plan may run as one job per worker at once)."""
        return self.plans.num_microbatch_for(num_microbatch)

    def default_plan(
        self, run_type: RunType | str, num_microbatch: int | None = None
    ) -> ModelExecutePlan:
        """The plan used when none is given: ``ModelExecutePlan.auto`` for this model.

        Planned from size-proportional estimates, then once more when the timer's averages
        rest on ``PlanChoice.DEFAULT_REPLAN_AFTER`` (3) measured iterations (one noisy
        measurement made identical models pick different plans); the new plan is taken
        only if predicted ``PlanChoice.DEFAULT_REPLAN_MIN_GAIN`` (5 %) faster.
        ``AutoReplan`` re-plans on demand.
        """
        return self.plans.default_plan(run_type, num_microbatch)

    def replan(
        self, run_type: RunType | str, min_gain: float | None = None, **auto_kwargs: Any
    ) -> ReplanDecision:
        """Plan ``run_type`` from the timer now and install the result for its calls
        (``set_plan``): the planner's choice if predicted at least ``min_gain``
        (default ``PlanChoice.DEFAULT_REPLAN_MIN_GAIN``, 5 %) faster than the plan in use,
        else the plan in use (:func:`~roundpipe_core.planning.planner.decide_replan`, the
        policy the default plan's own re-plan follows). ``auto_kwargs`` go to
        ``ModelExecutePlan.auto``; their ``concurrent`` (default: the pool's) also
        decides how the gain is simulated.

        Returns:
            The decision: old and candidate plan, predicted gain, whether it changed.
        """
        return self.plans.replan(run_type, min_gain, **auto_kwargs)

    @property
    def layer_activation_bytes(self) -> list[float] | None:
        """Saved-activation bytes per layer for one microbatch of the first training call
        (``None`` until measured), the last layer's with the loss's transient (see
        ``measure_activation_bytes``); the planner counts them. Set it
        (one number per layer) to give them without that measurement."""
        return self.plans.fits.activation_bytes

    @layer_activation_bytes.setter
    def layer_activation_bytes(self, value: list[float] | None) -> None:
        self.plans.set_activation_bytes(value)

    # -- call set-up -------------------------------------------------------------------------
    def _config(self, run_config: RoundPipeRunConfig | None) -> RoundPipeRunConfig:
        # every call, before compute: .compile() may be called on a layer after wrapping
        check_not_compiled_in_place(self.layers)
        if run_config is None:
            return self.model_run_config
        return check_run_config(run_config).merged_over(self.model_run_config)

    def _may_publish_in_background(self) -> bool:
        # every forward_backward waits per layer for the weights it reads (weight versions);
        # forward() waits for the whole copy; a unit of an automatic split does not wait
        return self._master_owner is None

    def _split(self, cfg: RoundPipeRunConfig, args: tuple, kwargs: dict) -> batching.SplitInputs:
        return batching.split_call_inputs(
            cfg.split_input, args, kwargs, self.num_microbatch_for(cfg.num_microbatch)
        )

    def _new_run(
        self,
        cfg: RoundPipeRunConfig,
        plan: ModelExecutePlan,
        run_type: RunType,
        grad_sink: Callable[[torch.Tensor, torch.Tensor], None],
        split: batching.SplitInputs,
        **kw: Any,
    ) -> PipelineRun:
        """A run of ``split``'s microbatches, its inputs in place."""
        if run_type != RunType.INFER and cfg.preserve_rng_state is not False:
            self.pool.warn_if_replay_differs()  # recompute replays the forward's draws
        # the base seed of its random streams: the process's seed and the call count
        # (seeded runs repeat; the global generator, the caller's sampler's, is not drawn)
        self._seed_calls += 1
        run = PipelineRun(
            self.layers,
            boundary_layers(plan, run_type),
            grad_sink,
            preserve_rng_state=cfg.preserve_rng_state is not False,  # (None: True)
            recompute_grain=parse_kind(
                RecomputeGrain, cfg.recompute_grain or RecomputeGrain.STAGE, "recompute_grain"
            ),
            rule_checker=self._rule_checker,
            rng_base=hash((torch.initial_seed(), self._seed_calls)) & (2**62 - 1),
            auto_cut=split.auto_cut,  # a layer's error lists what the automatic split cut
            **kw,
        )
        for i, mb in enumerate(split.parts):
            run.put_act(0, i, mb)
        return run

    def _execute(self, run: PipelineRun, jobs: list[Job]) -> None:
        run.caller_waits = True  # (pool.run waits for the jobs)
        self.pool.run(jobs_by_device(jobs, self.num_devices), lambda w, q: run_queue(run, w, q))
        self._call_done(run, jobs)

    def _call_done(
        self,
        run: PipelineRun,
        jobs: list[Job],
        t0: float | None = None,
        extent: Any = None,
        ok: bool = True,
    ) -> None:
        """The one writer of ``last_call``: a pipelined run is done (a non-blocking call's
        on its last worker's thread); one that succeeded gives its layer times to the timer."""
        timing = run.timing
        timing.schedule += jobs
        with self._timer_lock:
            if ok:
                timing.commit(self.model_timer)
                if t0 is not None:
                    timing.wall_ms = (time.perf_counter() - t0) * 1000.0
                    timing.samples, timing.tokens = extent
            self.__dict__["last_call"] = timing  # (nn.Module's setattr is slow)

    def _record_call(self, t0: float, args: Any, kwargs: Any) -> None:
        """Wall time and batch size of the call, on its last run's timing."""
        timing = self.last_call
        timing.wall_ms = (time.perf_counter() - t0) * 1000.0
        timing.samples, timing.tokens = batch_extent(args, kwargs)

    # -- pipelined calls -------------------------------------------------------------------
    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """Pipelined, microbatched forward of the whole model.

        Under grad mode (and ``requires_grad`` not False) the output is part of the
        autograd graph: ``loss.backward()`` runs the backward plan on the pool.
        """
        t0 = time.perf_counter()
        self._check_open("forward (rp(x))")
        cfg = self._config(roundpipe_run_config)
        self._steps.drain()  # their gradients stay buffered until the next step
        self._home().masters.take_back_grads()
        requires_grad = cfg.requires_grad
        if requires_grad is None:
            requires_grad = torch.is_grad_enabled() and bool(self._home().masters)
        run_type = RunType.TRAIN if requires_grad else RunType.INFER
        if requires_grad:
            self._check_param_hooks()
        with self._call_lock:
            split = self._split(cfg, args, kwargs)
            mbs = split.parts
            plan = self.plans.choose(roundpipe_run_config, run_type, cfg, split)
            if run_type == RunType.INFER:
                run = self._new_run(cfg, plan, run_type, self._no_grads, split)
                jobs = build_schedule(plan, run_type, self.num_devices, len(mbs))
                self._execute(run, jobs)
                merged = batching.merge_outputs(
                    cfg.merge_output, [run.outputs[i] for i in range(len(mbs))]
                )
                self._record_call(t0, args, kwargs)
                return to_output_device(merged, cfg.output_device)
        # a function's or packed merge has no per-microbatch adjoint; specs and the
        # automatic rule do (batch.MergedOutputs.split_output_grads)
        if callable(cfg.merge_output) or cfg.merge_output is False:
            raise ValueError(
                f"merge_output={cfg.merge_output!r} cannot be differentiated through; use it "
                "for inference (torch.no_grad() or requires_grad=False) or with "
                "forward_backward(), or give a merge spec (None, True, TensorChunkSpec, ...)"
            )
        home, hooks = self._home(), self._grad_hooks
        buffer = GradBuffer(home.masters.master_of, self._convert_grads_on_add())

        def merge_and_report(final: list[nn.Parameter]) -> None:
            home.masters.add_many(buffer.take(final))
            for hook in list(hooks):
                hook(final)

        def new_run(needs: list[bool], bwd_jobs: list[Job]) -> PipelineRun:
            # with gradient hooks, the backward's countdown: a master's complete gradient
            # enters .grad and the hooks after the step in flight (on its thread if need be)
            countdown = hooks and GradCompletion(
                bwd_jobs,
                lambda job: home.masters.of_layers([self.layers[i] for i in job.layers]),
                on_complete=lambda final: home._steps.after_step(
                    functools.partial(merge_and_report, final)
                ),
            )
            return self._new_run(
                cfg,
                plan,
                RunType.TRAIN,
                buffer.add,
                split,
                input_needs_grad=needs,
                grads_done=countdown.job_done if countdown else None,
            )

        def execute(run: PipelineRun, jobs: list[Job]) -> None:
            with self._call_lock:
                self._execute(run, jobs)
            if any(j.kind != "forward" for j in jobs):
                self._fold_grads(buffer)  # only a backward that completed leaves gradients

        out = AutogradForward(cfg, plan, split, self.num_devices, new_run, execute).run(
            args, kwargs
        )
        self._record_call(t0, args, kwargs)
        return out

    @staticmethod
    def _no_grads(param: torch.Tensor, grad: torch.Tensor) -> None:
        raise RuntimeError("an inference run produced a parameter gradient")

    def forward_backward(
        self,
        input_args: Any = (),
        input_kwargs: dict | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], Any] = default_loss_fn,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
        blocking: bool | None = None,
        loss_reduction: str | None = None,
    ) -> Any:
        """Forward, loss and backward in one pipelined pass (the last stage fuses them).

        Args:
            input_args / input_kwargs: the model's inputs (split into microbatches).
            label: labels, split like the inputs.
            loss_fn: ``loss_fn(output, label)`` per microbatch: a scalar tensor, or a
                tuple / list of scalar tensors (their sum is backpropagated). Default:
                the output itself is the loss.
            return_outputs: also return the merged outputs.
            run_config: per-call ``RoundPipeRunConfig``.
            blocking: ``None`` (default): ``True``, or what ``forward_backward_hook`` picks.
                ``True`` returns the issued call's ``result()``, ``False`` its
                ``PendingResult`` at once: each device starts on it as soon as it is done
                with the previous iterations, and a following ``step()`` is deferred until
                its gradients are complete. Results, parameters and gradients are those of
                the same blocking calls. A failure is raised by ``result()`` or the next call.
            loss_reduction: ``"sum"``, ``"mean"`` or ``None`` (this RoundPipe's
                ``loss_reduction``; :func:`~roundpipe_core.loss.microbatch_loss_weights`
                gives each microbatch's factor). A loss_fn marked
                :func:`~roundpipe_core.loss.batch_normalized` (``causal_lm_loss_fn``,
                ``model_output_loss``) is not reweighted.

        Returns:
            The sum of the (weighted) per-microbatch losses as a detached CPU tensor (a
            tuple of sums for a loss_fn returning several), or ``(loss, outputs)``; its
            gradients are accumulated into the masters' ``.grad`` only if the whole call
            succeeds. With ``blocking=False``: a ``PendingResult`` whose ``result()``
            returns that.
        """
        kwargs = dict(
            input_args=input_args,
            input_kwargs=input_kwargs,
            label=label,
            loss_fn=loss_fn,
            return_outputs=return_outputs,
            run_config=run_config,
            blocking=blocking,
            loss_reduction=loss_reduction,
        )
        hook = self.forward_backward_hook
        return (
            self._forward_backward(**kwargs)
            if hook is None
            else hook(self._forward_backward, kwargs)
        )

    def _forward_backward(
        self,
        input_args: Any,
        input_kwargs: dict | None,
        label: Any,
        loss_fn: Callable[[Any, Any], Any],
        return_outputs: bool,
        run_config: RoundPipeRunConfig | None,
        blocking: bool | None,
        loss_reduction: str | None = None,
    ) -> Any:
        self._check_open("forward_backward()")
        self._check_param_hooks()
        blocking = True if blocking is None else blocking
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(output, label), got {type(loss_fn).__name__}"
            )
        check_flag(blocking, "blocking")
        args = tuple(input_args) if isinstance(input_args, (tuple, list)) else (input_args,)
        kwargs = {} if input_kwargs is None else input_kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"input_kwargs must be a dict, got {type(kwargs).__name__}")
        check_inputs_need_no_grad(args, kwargs)
        reduction = check_loss_reduction(
            self.loss_reduction if loss_reduction is None else loss_reduction
        )
        cfg = self._config(run_config)
        factor = 1.0 if self.loss_multiplier is None else self.loss_multiplier()
        if not isinstance(factor, (int, float, torch.Tensor)) or isinstance(factor, bool):
            raise TypeError(f"loss_multiplier() must return a number, got {type(factor).__name__}")
        # One call path (docs/architecture.md#overlapped-iterations): a blocking call is
        # its handle's result; its gradients wait in its own buffer until result() or the
        # next step adds them to .grad, so a failed call leaves .grad as it was.
        if self._master_owner is not None:
            raise ValueError(
                "forward_backward is not supported on a RoundPipe whose masters another one "
                "owns (a unit of an automatic split): call the owner's forward"
            )
        steps = self._steps
        steps.raise_failure()
        self.masters.take_back_grads()
        t0 = time.perf_counter()
        with self._call_lock:
            split = self._split(cfg, args, kwargs)
            plan = self.plans.choose(run_config, RunType.FUSED, cfg, split)
            labels = batching.split_call_labels(
                cfg.split_label, label, len(split.parts), split.sizes, split.batch_size
            )
            weights = microbatch_loss_weights(
                reduction, loss_fn, split.sizes, split.batch_size, len(split.parts)
            )
            with steps.pipelined_call(blocking) as call:
                # continue round-robin where the previous call stopped: the device that
                # ran its last job is the last to become free, so this call starts elsewhere;
                # (fused_replicas: a one-stage plan as one job per CPU worker at once)
                jobs = build_schedule(
                    plan,
                    RunType.FUSED,
                    self.num_devices,
                    len(split.parts),
                    start_device=call.start_device,
                    replicas=fused_replicas(self, plan, len(split.parts)),
                )
                reader = call.reserve([j.layers for j in jobs], self.num_devices)
                buffer = GradBuffer(self.masters.master_of, self._convert_grads_on_add())
                # which masters are complete as the backward goes: the layer-wise step
                # and the gradient hooks read it
                completion = call.completion(
                    jobs, lambda job: self.masters.of_layers([self.layers[i] for i in job.layers])
                )
                run = self._new_run(
                    cfg,
                    plan,
                    RunType.FUSED,
                    buffer.add,
                    split,
                    loss_fn=loss_fn,
                    labels=labels,
                    return_outputs=return_outputs,
                    loss_scale=float(factor),
                    loss_weights=weights,
                    weights=call.weights,
                    reader=reader,
                    grads_done=completion.job_done,
                )
                run.caller_waits = blocking
                pending = PendingResult(
                    steps, run, buffer, cfg, len(split.parts), return_outputs, completion
                )
                call.pending_ref = weakref.ref(pending)
                futures = self.pool.submit(
                    jobs_by_device(jobs, self.num_devices), lambda w, q: run_queue(run, w, q)
                )
                call.launch(pending)
                pending.start(futures, RunFinisher(self, jobs, t0, batch_extent(args, kwargs)))
        return pending.result() if blocking else pending
