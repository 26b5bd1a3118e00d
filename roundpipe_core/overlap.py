"""Overlapping consecutive training iterations (``forward_backward(blocking=False)``).

With the asynchronous (one-step-stale) update, iteration k+1 computes with the
weights of step k-1, so it does not have to wait for iteration k to finish:
a device that is done with its part of iteration k can start on iteration k+1
while other devices still run k's backward tail. Three pieces make that exact:

* **Weight versions** (:class:`WeightVersions`). The host copy of the model's
  parameters is what devices upload. Version v = the weights produced by
  step v (0 = the initial ones). A pipelined run reads one version. The new
  version of a parameter may be copied into the host copy (*published*) only
  after every older-version run holding it has finished uploading it (device
  copies are private, so the host may change after the upload), and an upload
  of a layer waits until the version its run reads is published. Tied
  parameters are handled per parameter: all layers holding one are waited for.
* **Per-run gradient buffers** (:class:`GradBuffer`). Iteration k+1's gradients
  may arrive while step k still reads iteration k's. They collect in the run's
  own buffer and are added to the masters' ``.grad`` on the optimizer thread,
  after step k and just before step k+1 (or when the caller asks for the run's
  result) -- the order a blocking loop accumulates in.
* :class:`PendingResult`, the handle a non-blocking call returns.

``RoundPipe`` (model.py) ties them to its optimizer thread; this module holds
no policy about when steps run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from .devices.pool import PoolError

_WAIT_SLICE_S = 0.05


def _noop() -> None:
    return None


class _Reader:
    """A pipelined run as a reader of weight version ``version``: how many of its
    jobs still have to upload each layer, and the fences of the uploads issued."""

    def __init__(self, version: int, counts: dict[int, int]) -> None:
        self.version = version
        self.pending = counts
        self.fences: dict[int, list[Callable[[], None]]] = {}
        self.finished = False


class WeightVersions:
    """Which step's weights the host copy of each trainable parameter holds, and
    which pipelined runs still have to upload it.

    Args:
        layers: the model's layers.
        masters: ``(name, model_param, master_param)`` of the trainable parameters.
    """

    def __init__(
        self, layers: Sequence[nn.Module], masters: Sequence[tuple[str, nn.Parameter, nn.Parameter]]
    ) -> None:
        master_of = {id(p): (p, m) for _, p, m in masters}
        self._cond = threading.Condition()
        # per layer: the (model param, master) pairs it holds; per master: the layers holding it
        self.layer_pairs: list[list[tuple[nn.Parameter, nn.Parameter]]] = []
        self.holders: dict[int, list[int]] = {}
        self._pair: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        for i, layer in enumerate(layers):
            pairs = []
            for p in layer.parameters():  # deduplicated within the layer
                if id(p) in master_of:
                    pm = master_of[id(p)]
                    pairs.append(pm)
                    self.holders.setdefault(id(pm[1]), []).append(i)
                    self._pair[id(pm[1])] = pm
            self.layer_pairs.append(pairs)
        self.version: dict[int, int] = {k: 0 for k in self._pair}
        self._readers: list[_Reader] = []

    # -- readers (worker threads) ----------------------------------------------------
    def register(self, version: int, job_layers: Sequence[range]) -> _Reader:
        """A run that reads ``version`` and uploads each of ``job_layers`` once."""
        counts: dict[int, int] = {}
        for r in job_layers:
            for i in r:
                counts[i] = counts.get(i, 0) + 1
        reader = _Reader(version, counts)
        with self._cond:
            self._readers.append(reader)
        return reader

    def _ready(self, reader: _Reader, layers: Sequence[int]) -> bool:
        return all(
            self.version[id(m)] >= reader.version for i in layers for _, m in self.layer_pairs[i]
        )

    def ready(self, reader: _Reader, layers: Sequence[int]) -> bool:
        with self._cond:
            return self._ready(reader, layers)

    def wait_ready(
        self, reader: _Reader, layers: Sequence[int], failed: Callable[[], bool]
    ) -> None:
        """Block until ``layers`` hold ``reader``'s version; PoolError once ``failed()``."""
        with self._cond:
            while not self._ready(reader, layers):
                if failed():
                    raise PoolError("stopped waiting for weights to upload: the run was aborted")
                self._cond.wait(_WAIT_SLICE_S)

    def uploaded(self, reader: _Reader, layers: Sequence[int], fence: Callable[[], None]) -> None:
        """``reader`` issued the upload of ``layers``; ``fence()`` blocks until it has read the host."""
        with self._cond:
            for i in layers:
                reader.pending[i] -= 1
                reader.fences.setdefault(i, []).append(fence)
            self._cond.notify_all()

    def finish(self, reader: _Reader) -> None:
        """The run is over (done, failed or aborted): it uploads nothing more."""
        with self._cond:
            reader.finished = True
            if reader in self._readers:
                self._readers.remove(reader)
            self._cond.notify_all()

    # -- publication (optimizer thread) ------------------------------------------------
    def _blocked(self, mid: int, version: int) -> bool:
        return any(
            r.version < version and r.pending.get(i, 0) > 0
            for r in self._readers
            for i in self.holders[mid]
        )

    def publish(self, version: int, failed: Callable[[], bool]) -> None:
        """Copy the masters (holding step ``version``'s weights) into the model, each
        parameter as soon as no older-version run has still to upload it.

        Deep layers are released first (their last uploads are early backward stages);
        a pipelined run's forward of a layer starts as soon as that layer is published.
        """
        todo = [k for k, v in self.version.items() if v < version]
        while todo:
            with self._cond:
                while True:
                    if failed():
                        raise PoolError("weight publication stopped: a pipelined iteration failed")
                    ready = [k for k in todo if not self._blocked(k, version)]
                    if ready:
                        break
                    self._cond.wait(_WAIT_SLICE_S)
                fences = [
                    f
                    for r in self._readers
                    if r.version < version
                    for k in ready
                    for i in self.holders[k]
                    for f in r.fences.get(i, [])
                ]
            for fence in fences:  # async (CUDA) uploads must have read the host copy
                fence()
            with torch.no_grad():
                for k in ready:
                    p, m = self._pair[k]
                    p.copy_(m)
            with self._cond:
                for k in ready:
                    self.version[k] = version
                self._cond.notify_all()
            done = set(ready)
            todo = [k for k in todo if k not in done]

    def set_all(self, version: int) -> None:
        """The host copy was overwritten with the masters (``synchronize()``)."""
        with self._cond:
            for k in self.version:
                self.version[k] = version
            self._cond.notify_all()

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._readers)


class GradBuffer:
    """One pipelined run's gradients, summed per master until they may enter ``.grad``."""

    def __init__(self, master_of: dict[int, nn.Parameter]) -> None:
        self._master_of = master_of
        self._lock = threading.Lock()
        self.grads: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """The run's grad sink: ``(host param, downloaded grad)``."""
        master = self._master_of.get(id(param))
        if master is None:
            return
        grad = grad.to(master.dtype)
        with self._lock:
            hit = self.grads.get(id(master))
            if hit is None:
                self.grads[id(master)] = (master, grad)
            else:
                hit[1].add_(grad)

    def merge_into_masters(self, lock: threading.Lock) -> None:
        with self._lock:
            items, self.grads = list(self.grads.values()), {}
        with lock:
            for master, g in items:
                if master.grad is None:
                    master.grad = g
                else:
                    master.grad.add_(g)


class PendingResult:
    """The handle of a ``forward_backward(..., blocking=False)`` call.

    ``result()`` waits for the iteration, puts its gradients into the masters'
    ``.grad`` (after the step issued before the call has consumed the previous
    ones) and returns what the blocking call would have returned. A failure of
    the iteration -- or of an earlier one that aborted it -- is raised there.
    """

    def __init__(
        self,
        owner: Any,
        index: int,
        run: Any,
        buffer: GradBuffer,
        cfg: Any,
        num_microbatch: int,
        return_outputs: bool,
        prev_step: Future | None,
    ) -> None:
        self._owner = owner
        self.index = index  # pipelined calls of this RoundPipe, counted from 0
        self.run = run
        self.buffer = buffer
        self.cfg = cfg
        self.num_microbatch = num_microbatch
        self.return_outputs = return_outputs
        self.prev_step = prev_step
        self._futures: list[Future] = []
        self._finish: Callable[[PendingResult], Any] | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._left = 0
        self.error: BaseException | None = None
        self.merged = False
        self.job_spans: list[tuple[Any, int, float, float]] = []  # (job, device, start, end)

    def start(self, futures: list[Future], finish: Callable[[PendingResult], Any]) -> None:
        """Track the workers' futures; ``finish(self)`` runs once all are done."""
        self._futures, self._finish, self._left = futures, finish, len(futures)
        if not futures:
            self._complete()
        for f in futures:
            f.add_done_callback(self._worker_done)

    def _worker_done(self, _: Future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        errors = [f.exception() for f in self._futures if f.exception() is not None]
        if errors:
            primary = [e for e in errors if not isinstance(e, PoolError)]
            self.error = (primary or errors)[0]
        try:
            if self._finish is not None:
                self._finish(self)
        finally:
            self._done.set()

    def done(self) -> bool:
        """True once every job of the iteration has finished (or it failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the iteration's jobs (not for its gradients to reach ``.grad``)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"pipelined iteration {self.index} not done after {timeout} s")

    def result(self, timeout: float | None = None) -> Any:
        """The loss (or ``(loss, outputs)``) of the call; raises its error if it failed."""
        self.wait(timeout)
        return self._owner._pending_result(self)
