"""Running jobs on a worker: forward, fused forward+loss+backward, recompute+backward.

A ``PipelineRun`` holds one pipelined call's state: the host activations at layer
boundaries by ``(boundary, microbatch)``, the gradients flowing back, where its random
streams start (``streams.py``) and the losses. Jobs on different workers meet only
through it (a job waits for what it needs and publishes what it produces), so stages on
different devices overlap on different microbatches. A failed job aborts the run: every
waiting job stops (``PoolError``) instead of hanging.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch
from torch import nn

from ..batch import AutoSplitLeaf, auto_split_note, flatten
from ..context import AutocastState, LayerFrame, RecomputeStore, running_layer, set_frame
from ..kinds import JobKind, RecomputeGrain
from ..loss import call_loss_fn
from ..planning.schedule import Job
from .activations import (
    HostOutputs,
    grads_to_host,
    to_device,
    to_host,
)
from .devices.base import Worker
from .devices.pool import PoolError
from .replicas import JobGrads, replica_microbatches
from .streams import ComputeScope, replay_seed, seed_stream
from .timer import CallTiming, JobClock
from .transfer import (
    GradSink,
    StageReplica,
    WeightGate,
    batched_sink,
    release_stage,
    upload_job,
    write_back_buffers,
)

__all__ = ["PipelineRun", "run_queue"]

_WAIT_SLICE_S = 0.05


@dataclass(eq=False, repr=False)
class PipelineRun:
    """Shared state of one pipelined forward / backward / forward_backward call."""

    layers: list[nn.Module]
    boundaries: set[int]
    grad_sink: InitVar[GradSink]
    preserve_rng_state: bool = True
    recompute_grain: RecomputeGrain = RecomputeGrain.STAGE
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    labels: list[Any] = field(default_factory=list)
    return_outputs: bool = False
    input_needs_grad: list[bool] | None = None
    grads_done: Callable[[Job], None] | None = None
    rule_checker: Any = None  # checks.ForwardRuleChecker: layers' first forwards
    # the caller's autocast, re-entered on the worker threads (it is thread-local)
    autocast: AutocastState = field(default_factory=AutocastState.capture)
    loss_scale: float = 1.0  # multiplies each loss before its backward only
    loss_weights: list[float] | None = None  # per microbatch: its loss, returned and backpropagated
    # layer l's draws on microbatch m come from a stream seeded with (rng_base, l, m)
    rng_base: int = 0
    # the uploads' weight-version gate and this run's reader (pipelined.py); None: no
    # one writes the host weights during the run
    weights: WeightGate | None = None
    reader: Any = None
    # inputs the automatic split cut: a layer's error lists them
    auto_cut: tuple[AutoSplitLeaf, ...] = ()

    def __post_init__(self, grad_sink: GradSink) -> None:
        self.num_layers = len(self.layers)
        self.job_grads = JobGrads(batched_sink(grad_sink))  # replicas: in slice order
        self.store = RecomputeStore()
        # layers passed to rule_checker by any run (it checks a layer's first forward only)
        self.rules_checked: set[int] = set()
        if self.rule_checker is not None:
            with _PASSED_LOCK:
                self.rules_checked = _PASSED.setdefault(self.rule_checker, set())
        self._cond = threading.Condition()
        self._acts: dict[tuple[int, int], Any] = {}
        self._grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        # a blocking call: only then may CPU workers share the cores by default (cpu.py)
        self.caller_waits = False
        # where a stream is seeded (streams.py): every forward stage start (recorded by the
        # forward jobs) and backward one (the boundaries); every layer for grain "layer"
        self.seed_every_layer = self.recompute_grain == RecomputeGrain.LAYER
        self.stream_starts: set[int] = set(self.boundaries)
        self.outputs: dict[int, Any] = HostOutputs()  # built when read, after the run
        self.losses: dict[int, torch.Tensor] = {}
        self.failed: BaseException | None = None
        self.timing = CallTiming()  # what the call measured (the workers' clocks hand it over)

    # -- rendezvous -----------------------------------------------------------
    def put_act(self, boundary: int, mb: int, value: Any) -> None:
        with self._cond:
            self._acts[(boundary, mb)] = value
            self._cond.notify_all()

    def put_grad(self, boundary: int, mb: int, grads: list[torch.Tensor | None]) -> None:
        with self._cond:
            self._grads[(boundary, mb)] = grads
            self._cond.notify_all()

    def _wait(self, table: dict, key: tuple[int, int], what: str) -> Any:
        with self._cond:
            while key not in table:
                if self.failed is not None:
                    raise PoolError(f"stopped waiting for {what} {key}: another job failed")
                self._cond.wait(_WAIT_SLICE_S)
            return table[key]

    def get_act(self, boundary: int, mb: int) -> Any:
        return self._wait(self._acts, (boundary, mb), "the activation at layer boundary/microbatch")

    def get_grad(self, boundary: int, mb: int) -> list[torch.Tensor | None]:
        return self._wait(self._grads, (boundary, mb), "the gradient at layer boundary/microbatch")

    def take_grad(self, boundary: int, mb: int) -> list[torch.Tensor | None] | None:
        with self._cond:
            return self._grads.get((boundary, mb))

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.failed is None:
                self.failed = exc
            self._cond.notify_all()

    def drop_activations(self) -> None:
        """Free the saved boundary activations once backward no longer needs them."""
        with self._cond:
            self._acts.clear()


_PASSED: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
_PASSED_LOCK = threading.Lock()


def _requires_grad_inputs(
    value: Any, needs: list[bool] | None
) -> tuple[Any, list[torch.Tensor | None]]:
    """Detached copy of ``value`` whose differentiable leaves require grad, and per leaf
    the tensor whose ``.grad`` is the input gradient (None for leaves that take none)."""
    if isinstance(value, torch.Tensor):  # the common activation: no tree to walk
        if (value.is_floating_point() or value.is_complex()) and (
            needs is None or (len(needs) > 0 and needs[0])
        ):
            value = value.detach().requires_grad_(True)
            return value, [value]
        return value, [None]
    leaves, rebuild = flatten(value)
    tracked: list[torch.Tensor | None] = [
        x.detach().requires_grad_(True)
        if isinstance(x, torch.Tensor)
        and (x.is_floating_point() or x.is_complex())
        and (needs is None or (i < len(needs) and needs[i]))
        else None
        for i, x in enumerate(leaves)
    ]
    return rebuild([x if t is None else t for x, t in zip(leaves, tracked)]), tracked


def _backward(out: Any, grads: list[torch.Tensor | None]) -> None:
    leaves = [out] if isinstance(out, torch.Tensor) else flatten(out)[0]
    if len(leaves) != len(grads):
        raise RuntimeError(
            f"the stage output has {len(leaves)} leaves but {len(grads)} gradients arrived; "
            "a layer returns differently structured outputs in recompute than in forward"
        )
    tensors, gs = [], []
    plain = _run_backward is not None
    for x, g in zip(leaves, grads):
        if g is not None and isinstance(x, torch.Tensor) and x.requires_grad:
            tensors.append(x)
            gs.append(g)
            plain = plain and type(x) is type(g) is torch.Tensor
            plain = plain and x.shape == g.shape and x.dtype == g.dtype
    if not tensors:
        return
    if plain and _run_backward is not None:
        # Gradients of plain tensors of the same shape and dtype, as here by construction:
        # torch.autograd.backward would spend longer checking that (_make_grads) than a
        # small stage's backward takes; the C++ engine still validates the shapes.
        _run_backward(
            tuple(tensors),
            tuple(gs),
            False,
            False,
            (),
            allow_unreachable=True,
            accumulate_grad=True,
        )
    else:
        torch.autograd.backward(tensors, gs)


# the engine entry torch.autograd.backward calls after its checks (private: if a torch
# release moves it, every backward takes the public path)
_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _call_layer(layer: nn.Module, index: int, x: Any) -> Any:
    """nn.Sequential semantics: layer 0 gets the call's (*args, **kwargs), others the previous output."""
    if index == 0:
        args, kwargs = x
        return layer(*args, **kwargs)
    return layer(x)


def _run_layers(
    run: PipelineRun,
    job: Job,
    stage: StageReplica,
    worker: Worker,
    mb: int,
    x: Any,
    clock: JobClock,
    recompute: bool,
    publish: bool = False,
    inputs: list[Any] | None = None,
) -> Any:
    """Run the job's layers on ``x`` for microbatch ``mb``: the one loop of every forward
    and recompute. ``publish`` (forward jobs) hands on the activations at interior
    boundaries; ``inputs`` collects each layer's input (recompute grain "layer")."""
    r = job.layers
    seeding = not recompute or run.preserve_rng_state
    every, starts = run.seed_every_layer, run.stream_starts
    publish = publish and bool(run.boundaries)
    checker = None if recompute else run.rule_checker
    autocast = run.autocast.active(worker.device)
    kind = "re" if recompute else "fwd"
    time_point, marks = worker.time_point, clock.marks
    modules = stage.modules
    offset = job.layers.start
    frame = LayerFrame(r.start, mb, recompute, run.store, worker.device)
    prev = set_frame(frame)
    i = r.start
    try:
        t = time_point()
        for i in r:
            if publish and i != r.start and i in run.boundaries:
                run.put_act(i, mb, to_host(worker, x))
                t = time_point()  # the copy is not the layer's time
            if seeding and (i == r.start or every or i in starts):
                seed_stream(run, worker, i, mb)
            if inputs is not None:
                inputs.append(x)
            frame.layer = i
            module = modules[i - offset]
            if checker is not None and i not in run.rules_checked:
                # the checker watches a layer's first forward only; later ones skip its lock
                run.rules_checked.add(i)
                with autocast or nullcontext():
                    x = checker.run(i, module, lambda m=module, v=x, k=i: _call_layer(m, k, v))
            elif autocast is None:
                x = module(*x[0], **x[1]) if i == 0 else module(x)
            else:
                with autocast:
                    x = _call_layer(module, i, x)
            end = time_point()
            marks.append((kind, i, i + 1, t, end))
            t = end
    except BaseException as exc:
        _annotate(exc, run, job, i, mb, worker)
        raise
    finally:
        set_frame(prev)
    return x


def _annotate(
    exc: BaseException, run: PipelineRun, job: Job, layer: int | None, mb: int, worker: Worker
) -> None:
    notes = getattr(exc, "__notes__", None) or ()
    if any(n.startswith(_NOTE_PREFIX) for n in notes):
        return  # the layer loop has said where already
    span = f"layers {job.layers.start}..{job.layers.stop - 1}"
    where = f"layer {layer}" if layer is not None else span
    note = (
        f"{_NOTE_PREFIX}{where}, microbatch {mb}, {job.kind} stage {job.stage} "
        f"on device {worker.index} ({worker.device})"
    )
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        if (cut := auto_split_note(run.auto_cut)) is not None:  # a tensor not per-sample?
            exc.add_note(cut)


_NOTE_PREFIX = "RoundPipe: raised in "


# -- jobs -------------------------------------------------------------------------
def _microbatch(
    run: PipelineRun, job: Job, stage: StageReplica, worker: Worker, mb: int, clock: JobClock
) -> None:
    """One microbatch of a job: its inputs to the device (a fused job's label, a backward
    job's output gradients too, in the same copy), then its forward, its fused forward,
    loss and backward, or its recompute and backward."""
    r, kind = job.layers, job.kind
    if kind == JobKind.BACKWARD:
        grads_out = run.get_grad(r.stop, mb)
    else:
        run.stream_starts.add(r.start)  # a forward stage starts a stream (atomic insertion)
    value = run.get_act(r.start, mb)
    t_in = time.perf_counter()
    if kind == JobKind.FORWARD:
        x, held = to_device(worker, value)
    elif kind == JobKind.FUSED:
        x, label, held = to_device(worker, value, run.labels[mb])
    else:
        x, *g_dev, held = to_device(worker, value, *grads_out)
    worker.wait_channel("activation")
    clock.transfer("activation", f"{job} in mb{mb}", t_in)
    try:
        if kind == JobKind.FORWARD:
            with ComputeScope(worker, False, run, job):
                x = _run_layers(run, job, stage, worker, mb, x, clock, False, publish=True)
                last = r.stop == run.num_layers
                out = to_host(worker, x, build_later=last)  # the call's output if last
            if last:
                run.outputs[mb] = out
            run.put_act(r.stop, mb, out)
            return
        # the input leaves that take a gradient: every float leaf inside the model, at
        # layer 0 only the call's inputs that require grad
        needs = None if r.start else (run.input_needs_grad or [])
        layerwise = kind == JobKind.BACKWARD and run.recompute_grain == RecomputeGrain.LAYER
        # grain "layer" turns autograd on and off per layer itself
        with ComputeScope(worker, None if layerwise else True, run, job):
            if layerwise:
                tracked = _backward_layerwise(run, job, stage, worker, mb, x, g_dev, needs, clock)
            elif kind == JobKind.FUSED:
                x, tracked = _requires_grad_inputs(x, needs)
                x = _run_layers(run, job, stage, worker, mb, x, clock, recompute=False)
                _fused_loss_backward(run, worker, mb, x, label, clock, r)
            else:
                x, tracked = _requires_grad_inputs(x, needs)
                x = _run_layers(run, job, stage, worker, mb, x, clock, recompute=True)
                t0 = worker.time_point()
                _backward(x, g_dev)
                clock.span("bwd", r, t0)
            # the stage input's gradient, for the stage before (at layer 0: the caller)
            if r.start or any(needs or ()):
                grads = [t.grad if t is not None else None for t in tracked]
                run.put_grad(r.start, mb, grads_to_host(worker, grads))
    except BaseException as exc:
        _annotate(exc, run, job, None, mb, worker)
        raise
    finally:
        worker.release(held, "activation")


def _fused_loss_backward(
    run: PipelineRun, worker: Worker, mb: int, x: Any, label: Any, clock: JobClock, r: range
) -> None:
    """A fused job's end: the loss of the stage output ``x``, its backward, the loss (and,
    with ``return_outputs``, the output) downloaded."""
    with run.autocast.enter(worker.device):  # plain PyTorch computes the loss under it too
        loss = call_loss_fn(run.loss_fn, x, label, mb, worker)
    parts = _loss_parts(loss)
    if run.loss_weights is not None:  # loss_reduction="mean": the microbatch's share
        parts = [p * run.loss_weights[mb] for p in parts]
    t0 = worker.time_point()
    total = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
    (total * run.loss_scale if run.loss_scale != 1.0 else total).backward()
    clock.span("bwd", r, t0)
    host = worker.copy_out_lazy([p.detach() for p in parts])  # read after the queue
    run.losses[mb] = type(loss)(host) if isinstance(loss, (tuple, list)) else host[0]
    if run.return_outputs:
        run.outputs[mb] = to_host(worker, x, build_later=True)


def _loss_parts(loss: Any) -> list[torch.Tensor]:
    """The scalar losses ``loss_fn`` returned (one, or a tuple / list), checked as
    ``torch.autograd.backward`` would check them."""
    parts = list(loss) if isinstance(loss, (tuple, list)) else [loss]
    if not parts:
        raise TypeError("loss_fn returned an empty sequence; return a scalar loss tensor")
    for i, p in enumerate(parts):
        what = "loss_fn's result" if len(parts) == 1 else f"loss {i} of loss_fn's result"
        if not isinstance(p, torch.Tensor) or p.numel() != 1:
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else ""
            raise TypeError(
                f"{what} must be a scalar tensor (one loss per microbatch), got "
                f"{type(p).__name__}{shape}"
            )
        if not p.requires_grad:
            raise RuntimeError(
                f"{what} does not require grad and has no grad_fn, so there is nothing to "
                "backpropagate (plain loss.backward() fails the same way): compute the loss "
                "from the model's output with differentiable operations, not a constant or "
                "a detached tensor"
            )
    return [p.reshape(()) for p in parts]


def _backward_layerwise(
    run: PipelineRun,
    job: Job,
    stage: StageReplica,
    worker: Worker,
    mb: int,
    x_in: Any,
    g_dev: list[torch.Tensor | None],
    needs: list[bool] | None,
    clock: JobClock,
) -> list[torch.Tensor | None]:
    """Recompute grain "layer": each layer's input from a run without autograd, then one
    layer at a time recomputed and backpropagated (one layer's graph alive)."""
    r = job.layers
    inputs: list[Any] = []
    with torch.no_grad():
        _run_layers(run, job, stage, worker, mb, x_in, clock, recompute=True, inputs=inputs)
    grads = g_dev
    tracked: list[torch.Tensor | None] = []
    for pos in reversed(range(len(r))):
        layer_idx = r[pos]
        xin, tracked = _requires_grad_inputs(inputs[pos], needs if layer_idx == 0 else None)
        replay_seed(run, worker, layer_idx, mb)
        t0 = worker.time_point()
        with torch.enable_grad():
            with (
                running_layer(layer_idx, mb, True, run.store, worker.device),
                run.autocast.enter(worker.device),
            ):
                out = _call_layer(stage.layer(layer_idx), layer_idx, xin)
            _backward(out, grads)
        clock.span("bwd", range(layer_idx, layer_idx + 1), t0)
        grads = [t.grad if t is not None else None for t in tracked]
        inputs[pos] = None  # free as we go
    return tracked


def run_queue(run: PipelineRun, worker: Worker, jobs: list[Job]) -> None:
    """Run one worker's jobs in order, prefetching the next job's parameters."""
    prefetched: StageReplica | None = None
    clock = JobClock(worker)
    # the host modules do not change while a call's queue runs (a change during an
    # overlapped call is a race): each cached skeleton is checked once per queue
    epoch = object()
    try:
        for i, job in enumerate(jobs):
            if run.failed is not None:
                raise PoolError("another job of this run failed")
            t0 = time.perf_counter()
            uploading = prefetched is None  # a prefetched stage's upload is noted already
            stage = prefetched or upload_job(run, worker, job, i % 2, epoch=epoch)
            assert stage is not None
            prefetched = None
            try:
                worker.wait_channel("param")
                start = time.perf_counter()
                if uploading:
                    clock.transfer("upload", f"{job} params", t0)
                if i + 1 < len(jobs):
                    t0 = time.perf_counter()
                    prefetched = upload_job(
                        run, worker, jobs[i + 1], (i + 1) % 2, wait=False, epoch=epoch
                    )
                    if prefetched is not None:
                        clock.transfer("upload", f"{jobs[i + 1]} params", t0)
                for mb in job.microbatches:
                    _microbatch(run, job, stage, worker, mb, clock)
                if job.kind != JobKind.FORWARD:  # fused and backward jobs made gradients
                    t0 = time.perf_counter()
                    run.job_grads.download(job, stage)
                    clock.transfer("gradient", f"{job} grads", t0)
                    if run.grads_done is not None:
                        run.grads_done(job)
                if job.kind != JobKind.BACKWARD:  # a real forward may have written buffers
                    write_back_buffers(stage)
                clock.end_job(job, replica_microbatches(job), start)
            finally:
                release_stage(stage)
    except BaseException as exc:
        run.fail(exc)
        raise
    finally:
        run.timing.add(clock)
        if prefetched is not None:
            release_stage(prefetched)
