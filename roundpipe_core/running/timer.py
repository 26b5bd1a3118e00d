"""Per-layer timing: forward, recompute and backward estimates from measured runs.

The runtime records how long each job took (CUDA events on a GPU, a monotonic
clock on the CPU backend) and calls :meth:`ModelTimer.end_iteration` after every
pipelined call. The planner (:meth:`ModelExecutePlan.auto`) and the simulator
read the per-layer estimates.

Statistics, per layer and kind ("fwd", "re", "bwd"):

* before any measurement, estimates are proportional to the layer's size
  (parameter + buffer bytes); backward = 2 x forward, recompute = forward;
* the first iteration in which a (layer, kind) is measured is dropped
  (allocator warm-up, kernel autotuning, lazy initialisation);
* later iterations feed an exponential moving average with factor 0.9 and
  bias correction, so the first kept measurement is the estimate itself
  rather than a tenth of it.

A job runs several layers at once, so its time is split among them: a forward
or recompute record in proportion to the current estimates of that kind, a
backward record in proportion to the recompute estimates (backward cost follows
forward cost much more closely than parameter size does).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from ..kinds import check_int
from .carried import carried_bytes

if TYPE_CHECKING:
    from .devices.base import Worker

__all__ = ["JobClock", "ModelTimer"]

KINDS = ("fwd", "re", "bwd")
_INF = float("inf")

#: Milliseconds assumed per byte of layer state before anything was measured.
#: Only ratios matter to the planner; the scale makes the numbers readable
#: (a 100 MB fp32 layer starts at 1 ms forward).
PRIOR_MS_PER_BYTE = 1.0 / 100e6
#: A layer without parameters (activation, reshape) is not free: before
#: measurements it costs this share of the largest layer's estimate.
PRIOR_FLOOR_SHARE = 0.01


def _module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors counted once), and of
    the tensors an upload carries besides them (a quantized layer's quant state)."""
    seen: set[int] = set()
    total = carried_bytes(module)
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _module_param_bytes(module: nn.Module) -> int:
    """Bytes of a module's trainable parameters (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


class ModelTimer:
    """Moving-average per-layer times of one model.

    Thread-safe: device worker threads call :meth:`record` concurrently.

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
        self.layer_param_bytes: list[int] = [_module_bytes(m) for m in layers]
        self.layer_grad_bytes: list[int] = [_module_param_bytes(m) for m in layers]
        self._lock = threading.RLock()
        self._prior = self._size_prior(self.layer_param_bytes)
        # EMA state per kind and layer: biased average and number of kept samples.
        self._ema: dict[str, list[float]] = {k: [0.0] * self.num_layers for k in KINDS}
        self._count: dict[str, list[int]] = {k: [0] * self.num_layers for k in KINDS}
        # Iterations seen per kind and layer, counting the dropped first one.
        self._seen: dict[str, list[int]] = {k: [0] * self.num_layers for k in KINDS}
        # Records of the running iteration, summed per kind and layer.
        self._pending: dict[str, dict[int, float]] = {k: {} for k in KINDS}
        self.iterations = 0

    # -- estimates ------------------------------------------------------------
    @staticmethod
    def _size_prior(nbytes: Sequence[int]) -> list[float]:
        raw = [b * PRIOR_MS_PER_BYTE for b in nbytes]
        top = max(raw)
        floor = top * PRIOR_FLOOR_SHARE if top > 0 else 1.0
        return [max(r, floor) for r in raw]

    def _measured(self, kind: str, layer: int) -> float | None:
        n = self._count[kind][layer]
        if n == 0:
            return None
        return self._ema[kind][layer] / (1.0 - self.EMA_FACTOR**n)

    def _estimate(self, kind: str, layer: int) -> float:
        m = self._measured(kind, layer)
        if m is not None:
            return m
        if kind == "fwd":
            return self._prior[layer]
        if kind == "re":
            return self._estimate("fwd", layer)
        return 2.0 * self._estimate("fwd", layer)

    def estimate(self, kind: str, layer: int) -> float:
        """Current estimate (ms) of ``kind`` for one layer."""
        _check_kind(kind)
        with self._lock:
            return self._estimate(kind, layer)

    @property
    def fwd_ms(self) -> list[float]:
        """Forward estimate per layer (ms)."""
        return self._estimates("fwd")

    @property
    def re_ms(self) -> list[float]:
        """Recompute estimate per layer (ms); the forward estimate until measured."""
        return self._estimates("re")

    @property
    def bwd_ms(self) -> list[float]:
        """Backward estimate per layer (ms); 2 x forward until measured."""
        return self._estimates("bwd")

    def _estimates(self, kind: str) -> list[float]:
        with self._lock:
            return self._estimates_locked(kind, range(self.num_layers))

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
        """Record the measured time of running ``layers`` (all microbatches of one job).

        The time is split among the layers (see the module docstring) and added to
        this iteration's records; :meth:`end_iteration` folds them into the averages.
        With ``microbatches`` > 1 the time is divided by it, so estimates are per
        microbatch and calls with different microbatch counts average consistently.
        """
        self.record_many([(kind, layers, ms)], microbatches)

    def record_many(
        self,
        records: Sequence[tuple[str, range | Sequence[int], float]],
        microbatches: int = 1,
    ) -> None:
        """:meth:`record` for several ``(kind, layers, ms)`` of one job at once: the
        runtime hands a job's per-layer times over under one lock acquisition.

        Raises:
            ValueError: naming the bad kind, time, layer or microbatch count; nothing
                of ``records`` is recorded then.
        """
        check_int(microbatches, "microbatches")
        n = self.num_layers
        checked = []
        for kind, layers, ms in records:
            if kind not in KINDS:
                _check_kind(kind)
            if type(ms) is not float:
                ms = float(ms)
            if not 0 <= ms < _INF:  # negative, NaN or Inf: a broken clock, never a timing
                raise ValueError(f"measured time must be a finite number >= 0 ms, got {ms!r}")
            # the runtime's records: one unit-step range inside the model, checked at once
            if not (type(layers) is range and layers.step == 1 and 0 <= layers.start):
                if not isinstance(layers, (range, list, tuple)):
                    layers = list(layers)
                for i in layers:
                    if not 0 <= i < n:
                        raise ValueError(f"layer {i} is outside the timed layers 0..{n - 1}")
            elif layers.stop > n:
                raise ValueError(f"layer {layers.stop - 1} is outside the timed layers 0..{n - 1}")
            if not layers:
                continue
            checked.append((kind, layers, ms / microbatches))
        with self._lock:
            tables = self._pending
            for kind, layers, ms in checked:
                pending = tables[kind]
                if len(layers) == 1:
                    i = layers[0]
                    pending[i] = pending.get(i, 0.0) + ms
                    continue
                weights = self._estimates_locked("fwd" if kind == "fwd" else "re", layers)
                total = sum(weights)
                for i, w in zip(layers, weights):
                    share = w / total if total > 0 else 1.0 / len(layers)
                    pending[i] = pending.get(i, 0.0) + ms * share

    def record_sums(self, sums: dict[tuple[str, int, int], float]) -> None:
        """:meth:`record_many` of ``{(kind, start, stop): ms per microbatch}`` (what a
        :class:`JobClock` sums), without a record object per entry.

        Raises:
            ValueError: as :meth:`record_many`; nothing of ``sums`` is recorded then.
        """
        n = self.num_layers
        for (kind, a, b), ms in sums.items():
            if kind not in KINDS or not 0 <= a < b <= n or not 0 <= ms < _INF:
                # the checks of record_many name what is wrong (and record all if none is)
                self.record_many([(k, range(s, e), v) for (k, s, e), v in sums.items()])
                return
        with self._lock:
            tables = self._pending
            for (kind, a, b), ms in sums.items():
                pending = tables[kind]
                if b - a == 1:
                    pending[a] = pending.get(a, 0.0) + ms
                    continue
                layers = range(a, b)
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
                        est = self._measured(kind, i)
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
        with self._lock:
            for k in KINDS:
                self._ema[k] = [0.0] * self.num_layers
                self._count[k] = [0] * self.num_layers
                self._seen[k] = [0] * self.num_layers
                self._pending[k] = {}
            self.iterations = 0

    def __repr__(self) -> str:
        return (
            f"ModelTimer({self.num_layers} layers, {self.iterations} iterations, "
            f"measured={self.has_measurements()})"
        )


class JobClock:
    """A worker's timing marks for the jobs of one run, handed to a timer at once.

    A mark is ``(kind, start, stop, t0, t1)``: ``kind`` "fwd" / "re" / "bwd" of
    layers ``start..stop-1`` between two of the worker's time points. The runtime
    appends to ``marks`` directly in its layer loop (one tuple per layer);
    :meth:`end_job` adds a job's marks, per microbatch, to one sum per
    ``(kind, start, stop)`` over the worker's whole queue; :meth:`commit` gives the
    timer those sums in one call (one lock acquisition per worker and run, not per
    job). Summing before the timer splits a stage's time over its layers changes
    nothing: the split is linear and its weights hold still within an iteration.

    The queue's other records wait here too, for the run to take them in one go at
    the end of the queue: ``transfers`` (``(lane, device, name, start, end)``, host
    wall clock, see :meth:`transfer`), ``job_times`` (``(job, device, busy ms)``) and
    ``job_spans`` (``(job, device, start, end)``).

    Args:
        worker: the worker whose ``time_point`` / ``elapsed_ms`` made the marks.
    """

    __slots__ = ("worker", "marks", "sums", "_seconds", "transfers", "job_times", "job_spans")

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.transfers: list[tuple[str, int, str, float, float]] = []
        self.job_times: list[tuple[Any, int, float]] = []
        self.job_spans: list[tuple[Any, int, float, float]] = []
        self.marks: list[tuple[str, int, int, Any, Any]] = []
        # (kind, start, stop) -> ms per microbatch, summed over the ended jobs
        self.sums: dict[tuple[str, int, int], float] = {}
        # time points in seconds of one host clock (the CPU backend): no call per mark
        self._seconds = bool(getattr(worker, "time_points_are_seconds", False))

    def transfer(self, lane: str, name: str, start: float) -> None:
        """Record a transfer of ``lane`` ("upload", "activation", "gradient") that
        started at ``start`` (``time.perf_counter()``) and ended now."""
        self.transfers.append((lane, self.worker.index, name, start, time.perf_counter()))

    def span(self, kind: str, layers: range, start: Any) -> None:
        """Mark ``kind`` of ``layers`` from ``start`` (a time point) to now."""
        self.marks.append((kind, layers.start, layers.stop, start, self.worker.time_point()))

    def end_job(self, microbatches: int) -> float:
        """Add the marks of the job just run to the sums as ms per microbatch (so calls
        with different microbatch counts average consistently); returns the job's busy ms."""
        sums = self.sums
        total = 0.0
        if self._seconds:
            for kind, start, stop, a, b in self.marks:
                key = (kind, start, stop)
                ms = (b - a) * 1000.0
                sums[key] = sums.get(key, 0.0) + ms / microbatches
                total += ms
        else:
            elapsed = self.worker.elapsed_ms
            for kind, start, stop, a, b in self.marks:
                key = (kind, start, stop)
                ms = elapsed(a, b)
                sums[key] = sums.get(key, 0.0) + ms / microbatches
                total += ms
        self.marks.clear()
        return total

    @property
    def records(self) -> list[tuple[str, range, float]]:
        """The ``(kind, layers, ms per microbatch)`` records of the ended jobs."""
        return [(k, range(a, b), ms) for (k, a, b), ms in self.sums.items()]

    def commit(self, timer: Any) -> None:
        """Hand the records of every ended job to ``timer`` (a :class:`ModelTimer`, or
        anything with ``record``); nothing to a ``None`` timer."""
        sums, self.sums = self.sums, {}
        if timer is None or not sums:
            return
        add_sums = getattr(timer, "record_sums", None)
        if add_sums is not None:
            add_sums(sums)
            return
        records = [(k, range(a, b), ms) for (k, a, b), ms in sums.items()]
        many = getattr(timer, "record_many", None)
        if many is not None:
            many(records)
        else:
            for kind, layers, ms in records:
                timer.record(kind, layers, ms)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"timing kind must be one of {KINDS}, got {kind!r}")
