"""What a pipelined call measured (:class:`CallTiming`, from each worker's
:class:`JobClock`), and the per-layer estimates made from it (:class:`ModelTimer`,
read by the planner and the simulator; docs/layouts-and-planner.md, "Inputs").

Per layer and kind ("fwd", "re", "bwd"): before any measurement the forward estimate is
the planner's size prior (:func:`~roundpipe_core.planning.profile.size_prior_ms`),
backward = 2 x forward, recompute = forward; a (layer, kind)'s first measured
iteration is dropped (warm-up), later ones feed an exponential moving average (factor
0.9) with bias correction, so the first kept measurement is the estimate itself. A job
runs several layers, so its time is split among them in proportion to the current
estimates: of its kind for "fwd" and "re", of "re" for "bwd" (backward cost follows
forward cost much more closely than parameter size does).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from torch import nn

from ..kinds import check_int
from ..planning.profile import layer_sizes, size_prior_ms
from ..planning.schedule import Job
from .carried import carried_bytes
from .trace import Span

if TYPE_CHECKING:
    from .devices.base import Worker

__all__ = ["CallTiming", "JobClock", "JobTiming", "ModelTimer"]

KINDS = ("fwd", "re", "bwd")


class ModelTimer:
    """Moving-average per-layer times of one model.

    Thread-safe: calls commit their timings on worker threads while the planner reads.

    Attributes:
        num_layers: number of layers timed.
        layer_param_bytes: parameter + buffer bytes of each layer (what a stage
            upload moves).
        layer_grad_bytes: bytes of each layer's trainable parameters (what a
            backward stage downloads as gradients).
    """

    #: Print one line per layer and kind to stderr whenever an estimate changes.
    VERBOSE: ClassVar[bool] = False
    #: Weight of the previous average in the exponential moving average.
    EMA_FACTOR: ClassVar[float] = 0.9

    def __init__(self, layers: Sequence[nn.Module] | nn.Module) -> None:
        if isinstance(layers, nn.Module):
            layers = list(layers.children()) if isinstance(layers, nn.Sequential) else [layers]
        layers = list(layers)
        if not layers:
            raise ValueError("ModelTimer needs at least one layer")
        self.num_layers = len(layers)
        sizes = layer_sizes(layers)
        # an upload also carries what is not a parameter or buffer (a quantized layer's
        # quant state), which planning cannot see from the modules
        self.layer_param_bytes: list[int] = [
            b + carried_bytes(m) for b, m in zip(sizes.upload_bytes, layers)
        ]
        self.layer_grad_bytes: list[int] = sizes.grad_bytes
        self._lock = threading.RLock()
        self._prior = size_prior_ms(sizes.compute_bytes)  # the planner's, before measurements
        self.reset()

    # -- estimates ------------------------------------------------------------
    def _estimate(self, kind: str, layer: int) -> float:
        n = self._count[kind][layer]
        if n:
            return self._ema[kind][layer] / (1.0 - self.EMA_FACTOR**n)
        fwd = self._prior[layer] if kind == "fwd" else self._estimate("fwd", layer)
        return 2.0 * fwd if kind == "bwd" else fwd

    @property
    def fwd_ms(self) -> list[float]:
        """Forward estimate per layer (ms)."""
        with self._lock:
            return self._estimates_locked("fwd", range(self.num_layers))

    @property
    def re_ms(self) -> list[float]:
        """Recompute estimate per layer (ms); the forward estimate until measured."""
        with self._lock:
            return self._estimates_locked("re", range(self.num_layers))

    @property
    def bwd_ms(self) -> list[float]:
        """Backward estimate per layer (ms); 2 x forward until measured."""
        with self._lock:
            return self._estimates_locked("bwd", range(self.num_layers))

    def _estimates_locked(self, kind: str, layers: Sequence[int]) -> list[float]:
        """``_estimate`` of many layers; the measured ones without a call each (the
        planner reads every layer's estimate on every call)."""
        ema, count, f = self._ema[kind], self._count[kind], self.EMA_FACTOR
        return [
            ema[i] / (1.0 - f ** count[i]) if count[i] else self._estimate(kind, i) for i in layers
        ]

    def stage_ms(self, kind: str, layers: range | Sequence[int]) -> float:
        """Estimated time of a stage. ``kind``: "fwd", "re", "bwd", or the job kinds
        "forward" (= fwd), "backward" (= re + bwd) and "fused" (= fwd + bwd)."""
        parts = {
            "forward": ("fwd",),
            "backward": ("re", "bwd"),
            "fused": ("fwd", "bwd"),
        }.get(kind)
        if parts is None:
            _check_kind(kind)
            parts = (kind,)
        with self._lock:
            return sum(self._estimate(k, i) for k in parts for i in layers)

    def measured_iterations(self) -> int:
        """How many measured iterations the best-measured layer's average rests on
        (the dropped warm-up iteration not counted)."""
        with self._lock:
            return max((c for k in KINDS for c in self._count[k]), default=0)

    def has_measurements(self, kind: str | None = None) -> bool:
        """Whether any estimate (of ``kind``, or of any kind) comes from measurements."""
        kinds = KINDS if kind is None else (kind,)
        with self._lock:
            return any(c > 0 for k in kinds for c in self._count[k])

    # -- recording --------------------------------------------------------------
    def record(
        self, kind: str, layers: range | Sequence[int], ms: float, microbatches: int = 1
    ) -> None:
        """Record the measured time of running ``layers`` (all ``microbatches`` of one
        job; the time is divided by them, so calls of different counts average alike),
        split among the layers (module docstring) into this iteration's records, which
        :meth:`end_iteration` folds into the averages. ``ValueError`` names a bad kind,
        time, layer or microbatch count."""
        check_int(microbatches, "microbatches")
        _check_kind(kind)
        ms = _check_ms(ms)
        layers = list(layers)
        for i in layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"layer {i} is outside the timed layers 0..{self.num_layers - 1}")
        with self._lock:
            self._add_locked(kind, layers, ms / microbatches)

    def record_sums(self, *sums: dict[tuple[str, int, int], float]) -> None:
        """:meth:`record` of each ``{(kind, start, stop): ms per microbatch}`` (a
        :class:`CallTiming`'s, one per queue) under one lock; on a ``ValueError`` none is."""
        n = self.num_layers
        for (kind, a, b), ms in chain.from_iterable(map(dict.items, sums)):
            if kind not in KINDS or not 0 <= ms < math.inf or not 0 <= a < b <= n:
                _check_kind(kind)  # (one test per entry; these name what is wrong)
                _check_ms(ms)
                bad = a if not 0 <= a < n else b - 1
                raise ValueError(f"layer {bad} is outside the timed layers 0..{n - 1}")
        with self._lock:
            for (kind, a, b), ms in chain.from_iterable(map(dict.items, sums)):
                if b - a == 1:  # one layer's span (most are): no split, no call
                    pending = self._pending[kind]
                    pending[a] = pending.get(a, 0.0) + ms
                else:
                    self._add_locked(kind, range(a, b), ms)

    def _add_locked(self, kind: str, layers: Sequence[int], ms: float) -> None:
        """Add ``ms`` of ``kind`` over ``layers`` to this iteration's records."""
        pending = self._pending[kind]
        weights = self._estimates_locked("fwd" if kind == "fwd" else "re", layers)
        total = sum(weights)
        for i, w in zip(layers, weights):
            share = w / total if total > 0 else 1.0 / len(layers)
            pending[i] = pending.get(i, 0.0) + ms * share

    def end_iteration(self) -> None:
        """Fold this iteration's records into the moving averages."""
        lines = []
        with self._lock:
            self.iterations += 1
            f = self.EMA_FACTOR
            verbose = self.VERBOSE
            for kind in KINDS:
                pending, self._pending[kind] = self._pending[kind], {}
                seen, ema, count = self._seen[kind], self._ema[kind], self._count[kind]
                for i, x in sorted(pending.items()) if verbose else pending.items():
                    seen[i] += 1
                    if seen[i] == 1:
                        continue  # first measured iteration: warm-up, dropped
                    ema[i] = f * ema[i] + (1.0 - f) * x
                    count[i] += 1
                    if verbose:
                        est = self._estimate(kind, i)
                        lines.append(
                            f"Layer {i} {kind:<5}new record: {x:.3f} ms  new estimate: {est:.3f} ms"
                        )
        if lines:
            print("\n".join(lines), file=sys.stderr, flush=True)

    # -- persistence ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Averages and counters (for checkpoints; pending records are not saved)."""
        with self._lock:
            return {
                "num_layers": self.num_layers,
                "ema": {k: list(v) for k, v in self._ema.items()},
                "count": {k: list(v) for k, v in self._count.items()},
                "seen": {k: list(v) for k, v in self._seen.items()},
                "iterations": self.iterations,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned for a model with the same layers."""
        if state.get("num_layers") != self.num_layers:
            raise ValueError(
                f"timer state is for {state.get('num_layers')} layers but this model has "
                f"{self.num_layers}; load it into a timer of the same model"
            )
        with self._lock:
            for k in KINDS:
                self._ema[k] = [float(x) for x in state["ema"][k]]
                self._count[k] = [int(x) for x in state["count"][k]]
                self._seen[k] = [int(x) for x in state["seen"][k]]
                self._pending[k] = {}
            self.iterations = int(state.get("iterations", 0))

    def reset(self) -> None:
        """Forget all measurements (back to size-proportional estimates)."""
        n = self.num_layers
        with self._lock:
            # per kind and layer: the biased average and its number of kept samples, the
            # iterations seen (counting the dropped first one), this iteration's records
            self._ema: dict[str, list[float]] = {k: [0.0] * n for k in KINDS}
            self._count: dict[str, list[int]] = {k: [0] * n for k in KINDS}
            self._seen: dict[str, list[int]] = {k: [0] * n for k in KINDS}
            self._pending: dict[str, dict[int, float]] = {k: {} for k in KINDS}
            self.iterations = 0

    def __repr__(self) -> str:
        return (
            f"ModelTimer({self.num_layers} layers, {self.iterations} iterations, "
            f"measured={self.has_measurements()})"
        )


class JobTiming(NamedTuple):
    """One job of a call as it ran on ``device``: ``time.perf_counter()`` from its
    parameters on the device (``start_s``) to its last microbatch and gradient download
    done (``end_s``), and ``busy_ms``, its compute time by the device's own clock."""

    job: Job
    device: int
    start_s: float
    end_s: float
    busy_ms: float


class CallTiming:
    """Everything one pipelined call measured -- the one record the layer timer, the
    trace, the stage-time logger and the benchmarks read (``RoundPipe.last_call``,
    ``PendingResult.timing``; a ``forward()`` with autograd and its ``backward()``: one).

    Each worker queue hands its :class:`JobClock` over once, at its end (:meth:`add`);
    the layer times reach a :class:`ModelTimer` only through :meth:`commit`, once the
    call's jobs all succeeded -- so overlapping calls never mix their records within one
    timer iteration, and on CUDA every time was read from events the job had passed.

    Attributes:
        schedule: the jobs the call launched, in launch order.
        jobs: a :class:`JobTiming` per job that completed, in the order the queues ended.
        transfers: a :class:`~roundpipe_core.running.trace.Span` per transfer a worker
            waited on (lane "upload", "activation" or "gradient"; ``name`` e.g.
            ``"2F0 params"``), host wall clock: on CUDA the issue of the copy and any wait
            for it.
        wall_ms: the call's wall time as the caller saw it (for ``forward()``, the
            forward's); ``samples`` / ``tokens``: its batch size
            (:func:`~roundpipe_core.batch.tree.batch_extent`). Zero until the call
            returned, and for a call that failed.
    """

    def __init__(self) -> None:
        self.schedule: list[Job] = []
        self.jobs: list[JobTiming] = []
        self._transfers: list[tuple[int, str, str, float, float]] = []
        self.wall_ms = 0.0
        self.samples = self.tokens = 0
        # per queue, {(kind, start, stop): ms per microbatch} not yet given to the timer
        self._layer_ms: list[dict[tuple[str, int, int], float]] = []
        self._lock = threading.Lock()

    def add(self, clock: JobClock) -> None:
        """Take a worker queue's records (once per queue: its jobs never take this
        record's lock)."""
        with self._lock:
            self.jobs += clock.jobs
            self._transfers += clock.transfers
            self._layer_ms.append(clock.sums)
        clock.jobs, clock.transfers, clock.sums = [], [], {}

    def commit(self, timer: ModelTimer) -> None:
        """Fold the layer times added since the last commit into ``timer`` as one
        iteration."""
        with self._lock:
            sums, self._layer_ms = self._layer_ms, []
        timer.record_sums(*sums)
        timer.end_iteration()

    @property
    def transfers(self) -> list[Span]:
        # kept as tuples until read: a Span per transfer, tracked by the garbage collector
        # until the call ended, made it collect twice as often in a call of small layers
        return [Span(*t) for t in self._transfers]

    def device_busy_ms(self, num_devices: int) -> list[float]:
        """Compute time per device over the call's jobs."""
        busy = [0.0] * num_devices
        for t in self.jobs:
            busy[t.device] += t.busy_ms
        return busy

    def bubble_ratio(self, num_devices: int) -> float | None:
        """``1 - sum(busy) / (wall_ms x num_devices)``: the share of the devices' time
        in the call spent not computing; ``None`` without a wall time or jobs."""
        if self.wall_ms <= 0 or not self.jobs:
            return None
        busy = sum(self.device_busy_ms(num_devices))
        return max(0.0, 1.0 - busy / (self.wall_ms * num_devices))

    def __repr__(self) -> str:
        return (
            f"CallTiming({len(self.jobs)}/{len(self.schedule)} jobs, "
            f"{len(self._transfers)} transfers, wall_ms={self.wall_ms:.3f})"
        )


class JobClock:
    """A worker's timing marks for the jobs of one call's queue, handed to the call's
    :class:`CallTiming` at its end. A mark is ``(kind, start, stop, t0, t1)`` between two
    of ``worker``'s time points; the runtime appends to ``marks`` in its layer loop."""

    __slots__ = ("worker", "marks", "sums", "_seconds", "transfers", "jobs")

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.transfers: list[tuple[int, str, str, float, float]] = []  # Span's fields
        self.jobs: list[JobTiming] = []
        self.marks: list[tuple[str, int, int, Any, Any]] = []
        # (kind, start, stop) -> ms per microbatch, summed over the ended jobs
        self.sums: dict[tuple[str, int, int], float] = {}
        # time points in seconds of one host clock (the CPU backend): no call per mark
        self._seconds = bool(getattr(worker, "time_points_are_seconds", False))

    def transfer(self, lane: str, name: str, start: float) -> None:
        """Record a transfer of ``lane`` ("upload", "activation", "gradient") that
        started at ``start`` (``time.perf_counter()``) and ended now."""
        self.transfers.append((self.worker.index, lane, name, start, time.perf_counter()))

    def span(self, kind: str, layers: range, start: Any) -> None:
        """Mark ``kind`` of ``layers`` from ``start`` (a time point) to now."""
        self.marks.append((kind, layers.start, layers.stop, start, self.worker.time_point()))

    def end_job(self, job: Job, microbatches: int, start: float) -> JobTiming:
        """Add the marks of ``job``, just run, to the sums as ms per microbatch and note its
        timing from ``start`` (``time.perf_counter()``, its parameters ready) to now. On
        CUDA this reads the job's events, which its last microbatch has passed."""
        sums, total = self.sums, 0.0
        elapsed = None if self._seconds else self.worker.elapsed_ms
        for kind, a, b, t0, t1 in self.marks:
            ms = (t1 - t0) * 1000.0 if elapsed is None else elapsed(t0, t1)
            sums[kind, a, b] = sums.get((kind, a, b), 0.0) + ms / microbatches
            total += ms
        self.marks.clear()
        timing = JobTiming(job, self.worker.index, start, time.perf_counter(), total)
        self.jobs.append(timing)
        return timing


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"timing kind must be one of {KINDS}, got {kind!r}")


def _check_ms(ms: float) -> float:
    ms = float(ms)
    if not 0 <= ms < math.inf:  # negative, NaN or Inf: a broken clock, never a timing
        raise ValueError(f"measured time must be a finite number >= 0 ms, got {ms!r}")
    return ms
