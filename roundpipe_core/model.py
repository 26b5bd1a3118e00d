"""RoundPipe: wraps an ``nn.Sequential``, owns its layers, the optimizer's master
copies and the asynchronous step.

The wrapped module stays on the host. Each pipelined call splits the batch
into microbatches, builds the iteration's schedule (``schedule.py``) and runs
it on the device pool (``runtime.py``). Gradients land in the master copies
(``optim_parameters()``); ``step()`` runs the user's optimizer on them on a
dedicated thread and copies the result back into the module's own parameters.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from . import batch as batching
from .checks import ForwardRuleChecker
from .devices.pool import DevicePool, PoolError
from .kinds import RunType, parse_kind
from .overlap import GradBuffer, PendingResult, WeightVersions
from .plan import ModelExecutePlan
from .runtime import PipelineRun, run_queue
from .schedule import Job, boundary_layers, build_schedule, jobs_by_device
from .timer import ModelTimer

_PIN_CHOICES = ("alloc", "register", "off")
_GRAINS = ("stage", "layer")


@dataclass
class RoundPipeRunConfig:
    """How a pipelined call runs. ``None`` fields fall back to the model's config,
    then to the defaults noted here.

    Attributes:
        requires_grad: build an autograd graph in ``forward()`` (default: grad mode is
            on and the model has trainable parameters).
        output_device: where outputs are returned (default CPU).
        preserve_rng_state: replay the forward's RNG in recompute (default True).
        recompute_grain: "stage" (recompute a whole stage, then backward) or "layer"
            (recompute and backpropagate one layer at a time; less memory). Default "stage".
        num_microbatch: microbatches per call (default: number of devices + 1).
        split_input: ``f(args, kwargs, num_microbatch) -> [(args, kwargs), ...]``.
        split_label: ``f(label, num_microbatch) -> [label, ...]``.
        merge_output: ``f([output, ...]) -> output``.
        execute_plan: a ``ModelExecutePlan`` (default: planned automatically).
    """

    requires_grad: bool | None = None
    output_device: torch.device | str | None = None
    preserve_rng_state: bool | None = None
    recompute_grain: str | None = None
    num_microbatch: int | None = None
    split_input: Callable[..., Any] | None = None
    split_label: Callable[..., Any] | None = None
    merge_output: Callable[..., Any] | None = None
    execute_plan: ModelExecutePlan | None = None

    def merged_over(self, base: RoundPipeRunConfig) -> RoundPipeRunConfig:
        """This config with its ``None`` fields taken from ``base``."""
        return replace(
            base,
            **{
                f.name: getattr(self, f.name)
                for f in fields(self)
                if getattr(self, f.name) is not None
            },
        )


class _OptimCtxState(threading.local):
    depth = 0


_OPTIM_CTX = _OptimCtxState()


class OptimizerCtx:
    """Inside ``with OptimizerCtx():`` a RoundPipe's ``parameters()`` /
    ``named_parameters()`` are its master (optimizer) parameters, so
    ``torch.optim.AdamW(model.parameters())`` gets the fp32 masters."""

    def __enter__(self) -> OptimizerCtx:
        _OPTIM_CTX.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _OPTIM_CTX.depth -= 1


def _default_dtype_of(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


class RoundPipe(nn.Module):
    """Train or run an ``nn.Sequential`` whose state lives in host memory on a pool of devices.

    Args:
        model: an ``nn.Sequential`` (each child is a layer) or any module (one layer).
            It is wrapped in place: after ``synchronize()`` its parameters hold the
            trained values.
        optim_dtype: dtype of the master copies the optimizer updates (default: the
            model's). Typical: bf16/fp16 model, ``torch.float32`` masters.
        name: a name for logs.
        model_run_config: default ``RoundPipeRunConfig`` of this model's calls.
        pin_model: host memory of the parameters on CUDA: "alloc" (pinned copies),
            "register" (pin the existing storage) or "off" (pageable, e.g. mmap-loaded).
            Accepted and ignored on the CPU backend.
        devices: ``None`` (all GPUs, else ``ROUNDPIPE_CPU_DEVICES`` CPU workers, default 2),
            an int, ``"cpu:N"``, a list of devices, or the ``DevicePool`` of another RoundPipe.
        original_model: the object attribute lookups fall through to (a preset passes the
            Hugging Face model it converted); default ``model``.
        master_owner: another RoundPipe whose master copies cover this model's parameters
            (an automatic split runs parts of one model as inner RoundPipes): this one then
            makes no masters and accumulates its gradients into the owner's.
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        pin_model: str = "alloc",
        devices: Any = None,
        original_model: Any = None,
        master_owner: RoundPipe | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"RoundPipe wraps an nn.Module (ideally nn.Sequential), got {type(model).__name__}"
            )
        if isinstance(model, RoundPipe):
            raise TypeError("this model is already wrapped in RoundPipe")
        if pin_model not in _PIN_CHOICES:
            raise ValueError(f"pin_model must be one of {_PIN_CHOICES}, got {pin_model!r}")
        if optim_dtype is not None and not (
            isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point
        ):
            raise TypeError(
                f"optim_dtype must be a floating torch.dtype such as torch.float32, got {optim_dtype!r}"
            )
        if model_run_config is None:
            model_run_config = RoundPipeRunConfig()
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError(
                f"model_run_config must be a RoundPipeRunConfig, got {type(model_run_config).__name__}"
            )
        _check_run_config(model_run_config)

        self.model = model
        layers = list(model.children()) if isinstance(model, nn.Sequential) else [model]
        if not layers:
            raise ValueError("the nn.Sequential is empty; give it at least one layer")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(
            self, "_original_model", original_model if original_model is not None else model
        )
        self.name = name or type(model).__name__
        self.pin_model = pin_model
        self.model_run_config = model_run_config
        self.optim_dtype = optim_dtype or _default_dtype_of(model)

        object.__setattr__(
            self, "pool", devices if isinstance(devices, DevicePool) else DevicePool(devices)
        )
        self._owns_pool = not isinstance(devices, DevicePool)
        pin_handle = None
        if self.pool.is_cuda:
            from .devices import memory

            # pinned host memory makes uploads asynchronous; "register" must be undone at close
            pin_handle = memory.prepare_host_params(model, pin_model)

        # fp32 (optim_dtype) master copies of the trainable parameters; frozen ones get none.
        self._masters: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        self._master_of: dict[int, nn.Parameter] = {}
        if master_owner is not None and not isinstance(master_owner, RoundPipe):
            raise TypeError(f"master_owner must be a RoundPipe, got {type(master_owner).__name__}")
        object.__setattr__(self, "_master_owner", master_owner)
        for pname, p in model.named_parameters():
            if master_owner is None and p.requires_grad:
                m = nn.Parameter(p.detach().to(dtype=self.optim_dtype, copy=True))
                self._masters.append((pname, p, m))
                self._master_of[id(p)] = m
        self._grad_lock = threading.Lock()
        self._optimizer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"roundpipe-optim-{self.name}"
        )
        self._pending_step: Future | None = None
        self._step_guarded = False
        # -- pipelined (non-blocking) calls, see overlap.py --------------------------
        self._versions = WeightVersions(layers, self._masters)
        self._steps = 0  # step() calls so far; step k produces weight version k
        self._target_version = 0  # the version a call issued now computes with
        self._inflight: list[PendingResult] = []  # pipelined runs whose grads are not in .grad yet
        self._opt_tail: Future | None = None  # last task queued on the optimizer thread
        self._publish_tail: Future | None = None  # last weight publication queued
        self._failure: BaseException | None = None  # first failure of pipelined work
        self._failure_reported = False
        self._pipe_lock = threading.RLock()
        self._merge_lock = threading.Lock()  # taken before _pipe_lock, never while holding it
        self._timer_lock = threading.Lock()
        self._next_device = 0  # round-robin continues from one pipelined call to the next
        self._pipelined_calls = 0
        self.last_job_spans: list[tuple[Job, int, float, float]] = []
        self._call_lock = threading.RLock()
        self.model_timer = ModelTimer(layers)
        self._rule_checker = ForwardRuleChecker(layers)
        self._default_plans: dict[tuple[str, int], tuple[ModelExecutePlan, bool]] = {}
        self._grad_hooks: list[Callable[[list[nn.Parameter]], None]] = []
        self.last_schedule: list[Job] = []
        self.last_job_times: list[tuple[Job, int, float]] = []
        # -- hooks for adapters (e.g. the Lightning strategy) ---------------------------
        # loss_multiplier(): each microbatch loss of a forward_backward is multiplied by it
        # before its backward (gradient accumulation, loss scaling); the call returns the
        # unmultiplied loss.
        self.loss_multiplier: Callable[[], float] | None = None
        self._run_type_plans: dict[RunType, ModelExecutePlan] = {}
        # wall time and batch size of the last pipelined call (throughput / bubble logging)
        self.last_call_ms: float = 0.0
        self.last_call_samples: int = 0
        self.last_call_tokens: int = 0
        self._closer = weakref.finalize(
            self,
            _close_resources,
            self.pool if self._owns_pool else None,
            self._optimizer,
            pin_handle,
        )

    # -- attribute fall-through --------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original_model")
            if original is None:
                raise
            return getattr(original, name)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_devices(self) -> int:
        return len(self.pool)

    def __repr__(self) -> str:
        return f"RoundPipe(name={self.name!r}, layers={self.num_layers}, devices={self.pool!r})"

    # -- parameters ----------------------------------------------------------------
    def optim_parameters(self) -> list[nn.Parameter]:
        """The master copies the optimizer updates (trainable parameters only)."""
        return [m for _, _, m in self._masters]

    def optim_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, m) for n, _, m in self._masters]

    def master_param(self, param: torch.Tensor) -> nn.Parameter | None:
        """The master copy of one of the model's parameters (None if it is frozen)."""
        return self._master_of.get(id(param))

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        if _OPTIM_CTX.depth > 0:
            return iter(self.optim_parameters())
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        if _OPTIM_CTX.depth > 0:
            return iter(self.optim_named_parameters())
        return super().named_parameters(*args, **kwargs)

    def _accumulate_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self._master_owner is not None:
            self._master_owner._accumulate_grad(param, grad)
            return
        master = self._master_of.get(id(param))
        if master is None:
            return
        # The in-flight asynchronous step reads and clears the master grads: wait for it.
        self._wait_step_done()
        grad = grad.to(master.dtype)
        with self._grad_lock:
            if master.grad is None:
                master.grad = grad
            else:
                master.grad.add_(grad)

    def register_grad_hook(self, hook: Callable[[list[nn.Parameter]], None]) -> Callable[[], None]:
        """Call ``hook(masters)`` as soon as those master gradients are complete for the
        current pipelined call (every backward stage holding them has been accumulated).

        It runs on a worker thread while later stages still compute, so a data-parallel
        reducer can start reducing early layers (deep layers finish first). Returns a
        function that removes the hook.
        """
        self._grad_hooks.append(hook)
        return lambda: self._grad_hooks.remove(hook) if hook in self._grad_hooks else None

    def _grad_tracker(self, jobs: list[Job]) -> Callable[[Job], None] | None:
        """Count, per master, the gradient-producing jobs of a call; report a master
        to the grad hooks when its last job has been accumulated."""
        if not self._grad_hooks:
            return None
        owners: dict[int, list[nn.Parameter]] = {}
        remaining: dict[int, int] = {}
        for job in jobs:
            if job.kind == "forward":
                continue
            seen: dict[int, nn.Parameter] = {}
            for i in job.layers:
                for p in self.layers[i].parameters():
                    m = self._master_of.get(id(p))
                    if m is not None:
                        seen[id(m)] = m
            owners[job.index] = list(seen.values())
            for k in seen:
                remaining[k] = remaining.get(k, 0) + 1
        lock = threading.Lock()

        def done(job: Job) -> None:
            final = []
            with lock:
                for m in owners.get(job.index, []):
                    remaining[id(m)] -= 1
                    if remaining[id(m)] == 0:
                        final.append(m)
            if final:
                for hook in list(self._grad_hooks):
                    hook(final)

        return done

    # -- optimizer step ---------------------------------------------------------------
    def step(self, step_fn: Callable[[], Any], is_async: bool = True) -> None:
        """Run ``step_fn`` (e.g. ``lambda: (opt.step(), opt.zero_grad())``) on the master
        copies on the optimizer thread, then copy the masters into the model.

        With ``is_async=True`` it returns at once and the next call overlaps with the
        update; the new weights enter the model at the next ``step()`` / ``synchronize()``,
        so each iteration computes with weights one step stale (as upstream RoundPipe).

        After a non-blocking ``forward_backward(blocking=False)`` whose gradients are not
        in ``.grad`` yet, the step is deferred (this call does not wait): the optimizer
        thread runs it once those gradients are complete, and the previous step's weights
        reach the model layer by layer as the in-flight iterations stop reading the old
        ones -- the same math as the blocking loop.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        self._raise_failure()
        with self._pipe_lock:
            deferred = bool(self._inflight)
        if not deferred:
            self.synchronize()
            self._pending_step = self._opt_tail = self._optimizer.submit(step_fn)
            self._step_guarded = False  # its error is raised by synchronize()
            self._steps += 1
        else:
            self._defer_step(step_fn)
        if not is_async:
            self.synchronize()

    def _defer_step(self, step_fn: Callable[[], Any]) -> None:
        """Queue, on the optimizer thread: publish the last step's weights (as the blocking
        ``step()`` copies them at its call), then the step itself once the gradients of
        the pipelined runs issued before it are complete."""
        with self._pipe_lock:
            version = self._steps  # the blocking step() would copy this version into the model now
            runs = [r for r in self._inflight if not r.merged]
            self._target_version = version
            self._publish_tail = self._optimizer.submit(
                self._guarded, self._versions.publish, version, lambda: self._failure is not None
            )

            def deferred_step() -> None:
                for r in runs:
                    r.wait()
                    if r.error is not None:
                        raise r.error
                if self._failure is not None:
                    raise self._failure
                for r in runs:
                    self._merge_grads(r)
                step_fn()

            self._pending_step = self._opt_tail = self._optimizer.submit(
                self._guarded, deferred_step
            )
            self._step_guarded = True  # its error is raised through _raise_failure()
            self._steps += 1

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        """Optimizer-thread work of the pipelined path: a failure is recorded (and aborts
        the in-flight runs) instead of escaping, so it is raised exactly once, by the next call."""
        try:
            if self._failure is not None:
                return  # an earlier failure: everything queued after it is skipped
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - surfaced by _raise_failure()
            self._record_failure(exc)

    def _record_failure(self, exc: BaseException) -> None:
        with self._pipe_lock:
            if self._failure is None:
                self._failure = exc
                self._failure_reported = False
            runs = list(self._inflight)
        for r in runs:
            if r.run is not None:
                r.run.fail(PoolError("an earlier pipelined iteration or step failed"))

    def _drain(self) -> None:
        """Wait until every pipelined run in flight and the optimizer thread's queue have stopped."""
        with self._pipe_lock:
            runs = list(self._inflight)
        for r in runs:
            r.wait()
        tail = self._opt_tail
        if tail is not None:
            tail.exception()

    def _raise_failure(self) -> None:
        """After a pipelined failure: wait until everything in flight has stopped, put the
        masters into the model (the state the last good step left), raise the error once."""
        if self._failure is None:
            return
        self._drain()
        with self._pipe_lock:
            exc, reported = self._failure, self._failure_reported
            for r in self._inflight:
                r.buffer.grads.clear()  # a failed pipeline's gradients are dropped
            self._inflight.clear()
            self._failure = None
            self._pending_step = self._opt_tail = self._publish_tail = None
            self._copy_masters_to_model()
        if exc is not None and not reported:
            raise exc

    def _copy_masters_to_model(self) -> None:
        with torch.no_grad():
            for _, p, m in self._masters:
                p.copy_(m)
        self._versions.set_all(self._steps)
        self._target_version = self._steps

    def wait_step(self) -> None:
        """Block until the step queued by ``step()`` (if any) has finished; its error, if
        any, is raised by ``synchronize()``. The masters are then safe to read."""
        self._wait_step_done()

    def _wait_step_done(self) -> None:
        fut = self._pending_step
        if fut is not None:
            fut.exception()  # waits; the error itself is raised by synchronize()

    def _drain_runs(self) -> None:
        """Before a blocking call: wait for the pipelined runs and for the weights the
        model should hold now; their gradients stay buffered until the next step."""
        with self._pipe_lock:
            runs = list(self._inflight)
            publish = self._publish_tail
        for r in runs:
            r.wait()
        if publish is not None:
            publish.exception()
        self._raise_failure()

    def synchronize(self) -> None:
        """Wait for everything in flight -- pipelined iterations and steps -- (re-raising
        an error) and copy the masters into the model."""
        self._raise_failure()
        self._drain()
        self._raise_failure()
        with self._pipe_lock:
            leftover = list(self._inflight)
        for r in leftover:  # finished runs not followed by a step
            self._merge_grads(r)
        fut = self._pending_step
        if fut is None:
            return
        self._pending_step = self._opt_tail = self._publish_tail = None
        fut.result()
        with self._pipe_lock:
            self._copy_masters_to_model()

    # -- configuration -----------------------------------------------------------------
    def _config(self, run_config: RoundPipeRunConfig | None) -> RoundPipeRunConfig:
        if run_config is None:
            run_config = RoundPipeRunConfig()
        if not isinstance(run_config, RoundPipeRunConfig):
            raise TypeError(
                f"run_config must be a RoundPipeRunConfig, got {type(run_config).__name__}"
            )
        _check_run_config(run_config)
        return run_config.merged_over(self.model_run_config)

    def set_plan(self, run_type: RunType | str, plan: ModelExecutePlan | None) -> None:
        """Use ``plan`` for the calls of ``run_type`` ("infer", "train", "fused") that do
        not pass their own ``execute_plan``; ``None`` returns that run type to the model's
        default plan.

        Raises:
            TypeError: ``plan`` is not a ``ModelExecutePlan``.
            ValueError: ``run_type`` is unknown, or ``plan`` is not valid for this model,
                run type and device pool.
        """
        rt = parse_kind(RunType, run_type, "run_type")
        if plan is None:
            self._run_type_plans.pop(rt, None)
            return
        if not isinstance(plan, ModelExecutePlan):
            raise TypeError(f"plan must be a ModelExecutePlan or None, got {type(plan).__name__}")
        plan.check_valid(self.num_layers, rt, self.num_devices)
        self._run_type_plans[rt] = plan

    def plan_for(
        self, run_type: RunType | str, run_config: RoundPipeRunConfig | None = None
    ) -> ModelExecutePlan:
        """The plan a call of ``run_type`` with ``run_config`` runs.

        Precedence: ``run_config.execute_plan``, then the plan given to ``set_plan``,
        then ``model_run_config.execute_plan``, then ``default_plan``.
        """
        return self._resolve_plan(parse_kind(RunType, run_type, "run_type"), run_config)

    def _resolve_plan(
        self, run_type: RunType, run_config: RoundPipeRunConfig | None
    ) -> ModelExecutePlan:
        # not overridable on purpose: the calls resolve plans here, so a subclass's
        # plan_for cannot change which plan a call runs
        if run_config is not None and run_config.execute_plan is not None:
            return run_config.execute_plan
        plan = self._run_type_plans.get(run_type)
        if plan is not None:
            return plan
        if self.model_run_config.execute_plan is not None:
            return self.model_run_config.execute_plan
        m = run_config.num_microbatch if run_config is not None else None
        return self.default_plan(run_type, m or self.model_run_config.num_microbatch)

    def _plan(self, run_config: RoundPipeRunConfig | None, run_type: RunType) -> ModelExecutePlan:
        plan = self._resolve_plan(run_type, run_config)
        if not isinstance(plan, ModelExecutePlan):
            raise TypeError(f"execute_plan must be a ModelExecutePlan, got {type(plan).__name__}")
        plan.check_valid(self.num_layers, run_type, self.num_devices)
        return plan

    def default_plan(
        self, run_type: RunType | str, num_microbatch: int | None = None
    ) -> ModelExecutePlan:
        """The plan used when none is given: ``ModelExecutePlan.auto`` for this model.

        Planned once from size-proportional estimates, then once more when the timer
        has its first measurements (after the warm-up iteration); cached otherwise, so
        calls do not re-plan. ``ModelExecutePlan.auto`` / the ``AutoReplan`` callback
        re-plan on demand.
        """
        run_type = parse_kind(RunType, run_type, "run_type")
        m = num_microbatch or self.num_devices + 1
        measured = self.model_timer.has_measurements()
        key = (run_type, m)
        cached = self._default_plans.get(key)
        if cached is None or (measured and not cached[1]):
            plan = ModelExecutePlan.auto(run_type, self, num_microbatch=m)
            cached = (plan, measured)
            self._default_plans[key] = cached
        return cached[0]

    def _split(
        self, cfg: RoundPipeRunConfig, args: tuple, kwargs: dict
    ) -> tuple[list[tuple[tuple, dict]], list[int], int | None]:
        m = cfg.num_microbatch or self.num_devices + 1
        if cfg.split_input is not None:
            parts = [tuple(p) for p in cfg.split_input(args, kwargs, m)]
            if not parts:
                raise ValueError("split_input returned no microbatches")
            return [(tuple(a), dict(k)) for a, k in parts], [], None
        bs = batching.batch_size_of((args, kwargs))
        sizes = batching.split_sizes(bs, m)
        parts = batching.split_tree((args, kwargs), sizes, bs)
        return [(tuple(a), dict(k)) for a, k in parts], sizes, bs

    def _new_run(
        self,
        cfg: RoundPipeRunConfig,
        plan: ModelExecutePlan,
        run_type: str,
        grad_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        timer: Any = None,
        **kw: Any,
    ) -> PipelineRun:
        """A run's state; gradients go to the masters and times to the model timer unless
        a pipelined call gives its own buffer and timer."""
        return PipelineRun(
            self.layers,
            boundary_layers(plan, run_type),
            grad_sink or self._accumulate_grad,
            timer if timer is not None else self.model_timer,
            preserve_rng_state=bool(
                cfg.preserve_rng_state if cfg.preserve_rng_state is not None else True
            ),
            recompute_grain=cfg.recompute_grain or "stage",
            rule_checker=self._rule_checker,
            **kw,
        )

    def _execute(self, run: PipelineRun, jobs: list[Job]) -> None:
        self.pool.run(jobs_by_device(jobs, self.num_devices), lambda w, q: run_queue(run, w, q))
        self.model_timer.end_iteration()
        self.last_schedule = jobs
        self.last_job_times = list(run.job_times)

    # -- pipelined calls -------------------------------------------------------------------
    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """Pipelined, microbatched forward of the whole model.

        Under grad mode (and ``requires_grad`` not False) the output is part of the
        autograd graph: ``loss.backward()`` runs the backward plan on the pool.
        """
        t0 = time.perf_counter()
        cfg = self._config(roundpipe_run_config)
        self._drain_runs()
        requires_grad = cfg.requires_grad
        if requires_grad is None:
            requires_grad = torch.is_grad_enabled() and bool(self._masters)
        run_type = RunType.TRAIN if requires_grad else RunType.INFER
        with self._call_lock:
            plan = self._plan(roundpipe_run_config, run_type)
            mbs, sizes, bs = self._split(cfg, args, kwargs)
            if run_type == RunType.INFER:
                run = self._new_run(cfg, plan, run_type)
                for i, mb in enumerate(mbs):
                    run.put_act(0, i, mb)
                jobs = build_schedule(plan, run_type, self.num_devices, len(mbs))
                self._execute(run, jobs)
                out = _to_output_device(self._merge(cfg, run.outputs, len(mbs)), cfg.output_device)
                self._record_call(t0, args, kwargs)
                return out
        if cfg.merge_output is not None:
            raise ValueError(
                "a custom merge_output cannot be differentiated through; use it for inference "
                "(torch.no_grad() or requires_grad=False) or with forward_backward()"
            )
        out = _AutogradForward(self, cfg, plan, mbs, sizes, bs).run(args, kwargs)
        self._record_call(t0, args, kwargs)
        return out

    def _record_call(self, t0: float, args: Any, kwargs: Any) -> None:
        """Wall time and batch size of the call that started at ``t0``."""
        self.last_call_ms = (time.perf_counter() - t0) * 1000.0
        self.last_call_samples, self.last_call_tokens = batch_extent(args, kwargs)

    def _loss_factor(self) -> float:
        """The loss multiplier of this call, read once in the caller's thread."""
        if self.loss_multiplier is None:
            return 1.0
        # a subclass that overrides forward_backward and scales the loss itself must not
        # have the factor applied a second time (roundpipe_lightning's LightningRoundPipe)
        if type(self).forward_backward is not RoundPipe.forward_backward:
            return 1.0
        factor = self.loss_multiplier()
        if not isinstance(factor, (int, float, torch.Tensor)) or isinstance(factor, bool):
            raise TypeError(f"loss_multiplier() must return a number, got {type(factor).__name__}")
        return float(factor)

    def _merge(self, cfg: RoundPipeRunConfig, outputs: dict[int, Any], n: int) -> Any:
        ordered = [outputs[i] for i in range(n)]
        return (cfg.merge_output or batching.default_merge_output)(ordered)

    def forward_backward(
        self,
        input_args: tuple = (),
        input_kwargs: dict | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
        blocking: bool = True,
    ) -> Any:
        """Forward, loss and backward in one pipelined pass (the last stage fuses them).

        Args:
            input_args / input_kwargs: the model's inputs (split into microbatches).
            label: labels, split like the inputs.
            loss_fn: ``loss_fn(output, label) -> scalar`` per microbatch.
            return_outputs: also return the merged outputs.
            run_config: per-call ``RoundPipeRunConfig``.
            blocking: ``False`` queues the iteration on the devices and returns a
                ``PendingResult`` at once. Each device starts on it as soon as it is done
                with the previous iterations, so the next iteration's forward overlaps this
                one's backward tail. A following ``step()`` is deferred until the
                iteration's gradients are complete. Results, parameters and gradients are
                those of the same sequence of blocking calls (with ``step(is_async=True)``:
                one step stale). A failure is raised by ``result()`` or the next call.

        Returns:
            The sum of the per-microbatch losses (a detached CPU tensor), or
            ``(loss, outputs)``. Gradients of that sum are accumulated into the master
            copies' ``.grad``. With ``blocking=False``: a ``PendingResult`` whose
            ``result()`` returns that (and has put the gradients into ``.grad``).
        """
        if loss_fn is None or not callable(loss_fn):
            raise TypeError("forward_backward needs loss_fn(output, label) -> scalar tensor")
        if not isinstance(input_args, (tuple, list)):
            input_args = (input_args,)
        if input_kwargs is None:
            input_kwargs = {}
        if not isinstance(input_kwargs, dict):
            raise TypeError(f"input_kwargs must be a dict, got {type(input_kwargs).__name__}")
        t0 = time.perf_counter()
        cfg = self._config(run_config)
        factor = self._loss_factor()
        if not blocking:
            return self._forward_backward_pipelined(
                cfg,
                run_config,
                tuple(input_args),
                input_kwargs,
                label,
                loss_fn,
                return_outputs,
                factor,
            )
        self._drain_runs()
        with self._call_lock:
            plan = self._plan(run_config, RunType.FUSED)
            mbs, sizes, bs = self._split(cfg, tuple(input_args), input_kwargs)
            labels = self._split_label(cfg, label, mbs, sizes, bs)
            self._check_labels(labels, mbs)
            jobs = build_schedule(plan, RunType.FUSED, self.num_devices, len(mbs))
            run = self._new_run(
                cfg,
                plan,
                RunType.FUSED,
                loss_fn=loss_fn,
                labels=labels,
                return_outputs=return_outputs,
                grads_done=self._grad_tracker(jobs),
                loss_scale=factor,
            )
            for i, mb in enumerate(mbs):
                run.put_act(0, i, mb)
            self._execute(run, jobs)
            loss = torch.stack([run.losses[i] for i in range(len(mbs))]).sum()
            self._record_call(t0, input_args, input_kwargs)
            if return_outputs:
                return loss, _to_output_device(
                    self._merge(cfg, run.outputs, len(mbs)), cfg.output_device
                )
            return loss

    def _split_label(
        self, cfg: RoundPipeRunConfig, label: Any, mbs: list, sizes: list[int], bs: int | None
    ) -> list:
        if cfg.split_label is not None:
            return list(cfg.split_label(label, len(mbs)))
        return batching.split_tree(label, sizes, bs) if sizes else [label] * len(mbs)

    @staticmethod
    def _check_labels(labels: list, mbs: list) -> None:
        if len(labels) != len(mbs):
            raise ValueError(
                f"split_label gave {len(labels)} label parts for {len(mbs)} microbatches"
            )

    # -- pipelined (non-blocking) calls -------------------------------------------------------
    def _forward_backward_pipelined(
        self,
        cfg: RoundPipeRunConfig,
        run_config: RoundPipeRunConfig | None,
        args: tuple,
        kwargs: dict,
        label: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        return_outputs: bool,
        factor: float,
    ) -> PendingResult:
        if self._master_owner is not None:
            raise ValueError(
                "blocking=False is not supported on a RoundPipe whose masters another one owns"
            )
        if self._grad_hooks:
            raise ValueError(
                "blocking=False does not support gradient hooks (register_grad_hook, e.g. data-parallel "
                "overlap) yet; use blocking=True"
            )
        self._raise_failure()
        t0 = time.perf_counter()
        with self._call_lock, self._pipe_lock:
            plan = self._plan(run_config, RunType.FUSED)
            mbs, sizes, bs = self._split(cfg, args, kwargs)
            labels = self._split_label(cfg, label, mbs, sizes, bs)
            self._check_labels(labels, mbs)
            if self._pending_step is not None and not self._step_guarded:
                # a blocking-style step is in flight: its error must reach the pipelined
                # failure path (synchronize() would otherwise see only later, guarded steps)
                self._pending_step = self._opt_tail = self._optimizer.submit(
                    self._guarded, self._pending_step.result
                )
                self._step_guarded = True
            # continue round-robin where the previous call stopped: the device that ran its
            # last job is the last to become free, so this call's first job goes elsewhere
            jobs = build_schedule(
                plan, RunType.FUSED, self.num_devices, len(mbs), start_device=self._next_device
            )
            self._next_device = (self._next_device + len(jobs)) % self.num_devices
            buffer = GradBuffer(self._master_of)
            timer = _DeferredTimer()
            run = self._new_run(
                cfg,
                plan,
                RunType.FUSED,
                grad_sink=buffer.add,
                timer=timer,
                loss_fn=loss_fn,
                labels=labels,
                return_outputs=return_outputs,
                loss_scale=factor,
            )
            run.weights = self._versions
            run.reader = self._versions.register(self._target_version, [j.layers for j in jobs])
            for i, mb in enumerate(mbs):
                run.put_act(0, i, mb)
            queues = jobs_by_device(jobs, self.num_devices)

            def finish(p: PendingResult) -> None:
                self._versions.finish(run.reader)
                with self._timer_lock:
                    if p.error is None:
                        timer.replay(self.model_timer)
                        self.model_timer.end_iteration()
                    self.last_schedule = jobs
                    self.last_job_times = list(run.job_times)
                    self.last_job_spans = list(run.job_spans)
                p.job_spans = list(run.job_spans)
                if p.error is None:
                    self._record_call(t0, args, kwargs)
                run.drop_activations()  # the handle keeps losses and outputs only
                if p.error is not None:
                    if isinstance(p.error, PoolError) and self._failure is not None:
                        p.error = self._failure  # aborted because of that failure: report the cause
                    self._record_failure(p.error)

            # prev_step: the step that consumes the gradients issued before these
            pending = PendingResult(
                self,
                self._pipelined_calls,
                run,
                buffer,
                cfg,
                len(mbs),
                return_outputs,
                prev_step=self._opt_tail,
            )
            try:
                futures = self.pool.submit(queues, lambda w, q: run_queue(run, w, q))
            except BaseException:
                self._versions.finish(run.reader)
                raise
            self._inflight.append(pending)
            self._pipelined_calls += 1
            pending.start(futures, finish)
            return pending

    def _merge_grads(self, r: PendingResult) -> None:
        """Add a finished pipelined run's gradients to the masters' ``.grad`` (once).

        ``merged`` turns True only after the addition, under one lock: a step that finds
        the run merged (by ``result()`` on another thread) sees its gradients."""
        with self._merge_lock:
            if r.merged:
                return
            r.buffer.merge_into_masters(self._grad_lock)
            r.merged = True
            with self._pipe_lock:
                if r in self._inflight:
                    self._inflight.remove(r)

    def _pending_result(self, r: PendingResult) -> Any:
        if r.error is not None:
            with self._pipe_lock:
                if self._failure is r.error:
                    self._failure_reported = True
            raise r.error
        if r.prev_step is not None:
            r.prev_step.exception()  # that step consumed the gradients before these
        if not r.merged and self._failure is not None:
            self._raise_failure()  # its gradients were dropped with the failed pipeline
        with self._pipe_lock:
            # runs issued after the same step, up to this one, go into .grad together
            earlier = self._inflight[: self._inflight.index(r) + 1] if r in self._inflight else []
        for e in earlier:
            e.wait()  # never under _pipe_lock: a run's completion callback takes it
        for e in earlier:
            self._merge_grads(e)
        run = r.run
        loss = torch.stack([run.losses[i] for i in range(r.num_microbatch)]).sum()
        if r.return_outputs:
            return loss, _to_output_device(
                self._merge(r.cfg, run.outputs, r.num_microbatch), r.cfg.output_device
            )
        return loss

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the pending step and stop this RoundPipe's threads."""
        try:
            self.synchronize()
        finally:
            self._closer()


def _close_resources(
    pool: DevicePool | None, optimizer: ThreadPoolExecutor, pin_handle: Any = None
) -> None:
    optimizer.shutdown(wait=True)
    if pool is not None:
        pool.close()
    if pin_handle is not None:
        pin_handle.release()


def _check_run_config(cfg: RoundPipeRunConfig) -> None:
    if cfg.recompute_grain is not None and cfg.recompute_grain not in _GRAINS:
        raise ValueError(f"recompute_grain must be one of {_GRAINS}, got {cfg.recompute_grain!r}")
    n = cfg.num_microbatch
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"num_microbatch must be a positive int, got {n!r}")
    for name in ("split_input", "split_label", "merge_output"):
        f = getattr(cfg, name)
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be callable, got {type(f).__name__}")


def _to_output_device(value: Any, device: Any) -> Any:
    if device is None or torch.device(device).type == "cpu":
        return value
    leaves, rebuild = batching.flatten(value)
    return rebuild([x.to(device) if isinstance(x, torch.Tensor) else x for x in leaves])


class _DeferredTimer:
    """Collects a pipelined run's timings; they enter the ModelTimer when the run is done,
    so overlapping runs do not mix their records within one timer iteration."""

    def __init__(self) -> None:
        self._records: list[tuple[tuple, dict]] = []
        self._lock = threading.Lock()

    def record(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self._records.append((args, kwargs))

    def replay(self, timer: ModelTimer) -> None:
        with self._lock:
            records, self._records = self._records, []
        for args, kwargs in records:
            timer.record(*args, **kwargs)


class _AutogradForward:
    """forward() with autograd: the pipelined forward runs inside an autograd.Function
    whose backward runs the backward plan on the pool."""

    def __init__(
        self,
        rp: RoundPipe,
        cfg: RoundPipeRunConfig,
        plan: ModelExecutePlan,
        mbs: list,
        sizes: list[int],
        bs: int | None,
    ) -> None:
        self.rp, self.cfg, self.plan, self.mbs, self.sizes, self.bs = rp, cfg, plan, mbs, sizes, bs
        self.run_state: PipelineRun | None = None
        self.out_leaves: list[Any] = []
        self.out_rebuild: Any = None
        self.in_leaves: list[Any] = []

    def run(self, args: tuple, kwargs: dict) -> Any:
        self.in_leaves, _ = batching.flatten((args, kwargs))
        tensors = [x for x in self.in_leaves if isinstance(x, torch.Tensor)]
        dummy = torch.zeros((), requires_grad=True)
        outs = _PipelineFunction.apply(self, dummy, *tensors)
        it = iter(outs)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self.out_leaves]
        return _to_output_device(self.out_rebuild(leaves), self.cfg.output_device)

    def forward_phase(self, needs_grad: list[bool]) -> tuple[torch.Tensor, ...]:
        rp = self.rp
        # which leaves of the (args, kwargs) pytree take a gradient
        it = iter(needs_grad)
        needs = [next(it) if isinstance(x, torch.Tensor) else False for x in self.in_leaves]
        run = rp._new_run(self.cfg, self.plan, RunType.TRAIN, input_needs_grad=needs)
        for i, mb in enumerate(self.mbs):
            run.put_act(0, i, mb)
        with rp._call_lock:
            jobs = build_schedule(
                self.plan, RunType.TRAIN, rp.num_devices, len(self.mbs), phase="forward"
            )
            rp._execute(run, jobs)
        self.run_state = run
        self.num_fwd_jobs = len(jobs)
        merged = rp._merge(self.cfg, run.outputs, len(self.mbs))
        self.out_leaves, self.out_rebuild = batching.flatten(merged)
        return tuple(x for x in self.out_leaves if isinstance(x, torch.Tensor))

    def backward_phase(
        self, grad_outputs: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        rp, run = self.rp, self.run_state
        if run is None:
            raise RuntimeError("backward through a RoundPipe forward can only run once")
        n = len(self.mbs)
        # split each output gradient like the output was merged (per leaf, all leaves)
        it = iter(grad_outputs)
        per_leaf: list[list[torch.Tensor | None]] = []
        for leaf in self.out_leaves:
            g = next(it) if isinstance(leaf, torch.Tensor) else None
            if g is None:
                per_leaf.append([None] * n)
            elif leaf.dim() >= 1 and self.sizes and leaf.shape[0] == sum(self.sizes) and n > 1:
                per_leaf.append(list(torch.split(g, self.sizes, dim=0)))
            else:
                per_leaf.append([g] * n)
        for m in range(n):
            run.put_grad(rp.num_layers, m, [pl[m] for pl in per_leaf])
        with rp._call_lock:
            jobs = build_schedule(
                self.plan,
                RunType.TRAIN,
                rp.num_devices,
                n,
                phase="backward",
                start_device=self.num_fwd_jobs % rp.num_devices,
            )
            run.grads_done = rp._grad_tracker(jobs)
            rp._execute(run, jobs)
        run.drop_activations()
        self.run_state = None
        # merge input gradients over microbatches
        grads: list[torch.Tensor | None] = []
        for i, leaf in enumerate(self.in_leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            parts = [(run.take_grad(0, m) or [None] * len(self.in_leaves))[i] for m in range(n)]
            if all(p is None for p in parts):
                grads.append(None)
                continue
            split = self.bs is not None and leaf.dim() >= 1 and leaf.shape[0] == self.bs and n > 1
            parts_t = [
                p if p is not None else torch.zeros_like(leaf if not split else leaf[:s])
                for p, s in zip(parts, self.sizes or [0] * n)
            ]
            grads.append(torch.cat(parts_t, 0) if split else torch.stack(parts_t).sum(0))
        return grads


class _PipelineFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, call: _AutogradForward, dummy: torch.Tensor, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)
        outs = call.forward_phase(list(ctx.needs_input_grad[2:]))
        non_diff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        grads = ctx.call.backward_phase(grad_outputs)
        return (None, None, *grads)


def batch_extent(args: Any, kwargs: Any) -> tuple[int, int]:
    """(samples, tokens) of a call: the leading dimension of the first input tensor and,
    if that tensor holds integer token ids (two or more dimensions), its number of
    elements (else 0)."""
    stack: list[Any] = [args, kwargs]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            samples = int(x.shape[0]) if x.dim() > 0 else 1
            integral = not (x.is_floating_point() or x.is_complex())
            return samples, (x.numel() if integral and x.dim() >= 2 else 0)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return 0, 0
