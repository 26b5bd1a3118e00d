"""The device pool of this process: parse the ``devices`` argument, own the
workers, and run a schedule (one queue of jobs per worker) on them."""

from __future__ import annotations

import atexit
import contextlib
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any

import torch

from .base import Worker
from .cpu import (
    _GATE,
    CLEAN_RUNS_BEFORE_SHARING,
    SHARE_ALWAYS,
    SHARE_NEVER,
    CPUWorker,
    cpu_sharing_from_env,
)

__all__ = [
    "DEFAULT_CPU_DEVICES",
    "DevicePool",
    "PoolError",
    "optimizer_thread_cap",
    "resolve_devices",
]

DEFAULT_CPU_DEVICES = 2
#: Seconds a new pool waits for each worker thread to set itself up (CUDA context creation).
WORKER_START_TIMEOUT_S = 120.0
_live_pools: weakref.WeakSet = weakref.WeakSet()


def _cpu_count(text: str | None = None, what: str = "ROUNDPIPE_CPU_DEVICES") -> int:
    """``text`` (default: the variable) as a positive count in the digits 0-9 (``int()``
    would read "+3" or "٣"); ValueError naming ``what`` otherwise."""
    if text is None:
        text = os.environ.get("ROUNDPIPE_CPU_DEVICES", str(DEFAULT_CPU_DEVICES))
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
        raise ValueError(f"{what} must be a positive integer in the digits 0-9, got {text!r}")
    return int(text)


def resolve_devices(devices: Any) -> list[torch.device]:
    """One ``torch.device`` per worker from the ``devices`` argument: ``None``, every
    CUDA GPU if any, else ``ROUNDPIPE_CPU_DEVICES`` (default 2) CPU workers; an ``int``,
    that many of the default kind; ``"cpu:N"``; a list of devices, one worker each."""
    has_cuda = torch.cuda.is_available()
    if devices is None:
        devices = torch.cuda.device_count() if has_cuda else _cpu_count()
    if isinstance(devices, bool):
        raise TypeError("devices must be None, an int, 'cpu:N' or a list of devices, got a bool")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        if has_cuda:
            if devices > torch.cuda.device_count():
                raise ValueError(
                    f"devices={devices} but only {torch.cuda.device_count()} CUDA GPU(s) are visible"
                )
            return [torch.device("cuda", i) for i in range(devices)]
        return [torch.device("cpu")] * devices
    if isinstance(devices, str):
        if devices == "cpu":
            return [torch.device("cpu")] * _cpu_count()
        if devices.startswith("cpu:"):
            return [torch.device("cpu")] * _cpu_count(devices[4:], "N of devices='cpu:N'")
        return resolve_devices([devices])
    if isinstance(devices, Sequence):
        if len(devices) == 0:
            raise ValueError("devices is an empty list; give at least one device")
        out = []
        for d in devices:
            try:
                dev = torch.device(d)
            except (TypeError, RuntimeError) as exc:
                raise TypeError(f"devices entry {d!r} is not a device: {exc}") from None
            if dev.type == "cuda":
                if not has_cuda:
                    raise ValueError(
                        f"devices entry {d!r} asks for CUDA, but no CUDA GPU is available"
                    )
                if dev.index is None:
                    dev = torch.device("cuda", 0)
            elif dev.type != "cpu":
                raise ValueError(
                    f"devices entry {d!r}: only 'cpu' and 'cuda' devices are supported"
                )
            out.append(dev)
        return out
    raise TypeError(
        f"devices must be None, an int, 'cpu:N' or a list of devices, got {type(devices).__name__}"
    )


class PoolError(RuntimeError):
    """Raised in a job that stopped because another job of the same run failed."""


def optimizer_thread_cap(cores: int, gpu_workers: int) -> int | None:
    """``cores - gpu_workers`` when ``cores > 4 * gpu_workers``, else None (too few cores
    to give any away: the step keeps them all)."""
    if gpu_workers < 1 or cores <= 4 * gpu_workers:
        return None
    return cores - gpu_workers


class DevicePool:
    """The workers of this process, one thread each."""

    def on_worker_thread(self) -> bool:
        """Whether the caller runs on one of this pool's worker threads (inside a job:
        a layer's forward, a ``loss_fn``, a hook)."""
        return any(w.is_current() for w in self.workers)

    def __init__(self, devices: Any = None) -> None:
        devs = resolve_devices(devices)
        self.workers: list[Worker] = []
        self._closed = False
        self._replay_checked = False  # warn_if_replay_differs said its piece
        try:
            num_cpu = sum(d.type == "cpu" for d in devs)
            #: ``ROUNDPIPE_CPU_CONCURRENT`` when the pool was built (:func:`cpu_sharing_from_env`)
            self.cpu_sharing = cpu_sharing_from_env()
            self.cpu_concurrent = self.cpu_sharing != SHARE_NEVER
            # ATen gives a thread its intra-op count at its first parallel call from the
            # last count any thread set: the caller's is fixed now, before a worker sets
            # its share (devices/cpu.py, _use_threads)
            torch.get_num_threads()
            for i, d in enumerate(devs):
                if d.type == "cpu":
                    cpu_worker = CPUWorker(i)
                    cpu_worker.share = num_cpu
                    cpu_worker.concurrent = self.cpu_concurrent
                    cpu_worker.share_always = self.cpu_sharing == SHARE_ALWAYS
                    self.workers.append(cpu_worker)
                else:
                    from .cuda import CUDAWorker  # imported lazily: CUDA pieces stay optional
                    from .memory import default_allocator_settings

                    default_allocator_settings()  # before the worker starts CUDA
                    self.workers.append(CUDAWorker(i, d))
            # A worker whose thread set-up failed would fail every job it is given while
            # the other workers wait for its activations: refuse the pool up front.
            for w in self.workers:
                w.wait_started(WORKER_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        _live_pools.add(self)

    def __len__(self) -> int:
        return len(self.workers)

    def __repr__(self) -> str:
        return f"DevicePool({[str(w.device) for w in self.workers]})"

    @property
    def is_cuda(self) -> bool:
        return any(w.device.type == "cuda" for w in self.workers)

    @property
    def concurrent(self) -> bool:
        """Whether the devices compute at the same time on hardware of their own: GPUs.
        CPU workers share the process's cores (under one gate; side by side only on
        shares of them, ``cpu_overlap``): on them the step is synchronous and the masters
        are shared."""
        return self.is_cuda

    @property
    def cpu_overlap(self) -> bool:
        """Whether this pool's CPU workers compute at the same time, each on its share of
        the cores (two or more, ``ROUNDPIPE_CPU_CONCURRENT`` not ``0``; see ``cpu.py``):
        the planner weighs a plan whose stages overlap by it."""
        return self.cpu_concurrent and sum(w.kind == "cpu" for w in self.workers) >= 2

    @property
    def cpu_stages_overlap(self) -> bool:
        """Whether any two stages of a call, not only a stage's replicas, compute side by
        side on these CPU workers (``ROUNDPIPE_CPU_CONCURRENT=1``)."""
        return self.cpu_overlap and self.cpu_sharing == SHARE_ALWAYS

    def stages_draw(self, layers: Sequence[Any]) -> bool:
        """Whether a stage starting at one of these host layers was seen to draw from the
        CPU generator (it then runs alone)."""
        return _GATE.draws_seen(layers)

    def learned_draws(self, layers: Sequence[Any]) -> list[list[Any]]:
        """``ComputeGate.learned`` of these host layers, for a checkpoint."""
        return _GATE.learned(layers)

    def restore_draws(self, layers: Sequence[Any], rows: Any) -> None:
        """Restore :meth:`learned_draws`'s rows (``ValueError`` for rows of another model)."""
        _GATE.relearn(layers, rows)

    def stage_shares_cores(self, layers: Sequence[Any], kind: str, start: int, stop: int) -> bool:
        """Whether the ``kind`` stage of host ``layers[start:stop]`` (in their current
        mode) computes beside other stages: ``cpu_overlap``, and it ran alone without a
        draw in ``cpu.CLEAN_RUNS_BEFORE_SHARING`` microbatches."""
        if not self.cpu_overlap:
            return False
        owner = layers[start]
        runs = _GATE.runs_without_draw(owner, (kind, start, stop, owner.training))
        return runs >= CLEAN_RUNS_BEFORE_SHARING

    @property
    def cuda_workers(self) -> int:
        """Workers that drive a GPU (CUDA workers, also the fake-CUDA test double's)."""
        return sum(w.kind == "cuda" for w in self.workers)

    @property
    def unreplayed_host_draws(self) -> bool:
        """Whether a worker's recompute would not replay CPU random draws of a layer: a
        CUDA worker's replayed state is its GPU's generator, not the host's."""
        return any(not w.draws_from_host_generator for w in self.workers)

    def optimizer_threads(self) -> int | None:
        """Intra-op threads for the optimizer thread, or None for the default: a CUDA
        worker's controller thread and feeder need a core to keep its GPU fed
        (:func:`optimizer_thread_cap`; on CPU pools the step is synchronous)."""
        return optimizer_thread_cap(torch.get_num_threads(), self.cuda_workers)

    def warn_if_replay_differs(self) -> None:
        """Warn once when a recompute may run on a GPU of another SM count than its forward:
        a kernel's random draws follow its launch grid, which follows the SM count."""
        if self._replay_checked:
            return
        self._replay_checked = True
        indices = {getattr(w, "gpu_index", None) for w in self.workers}
        if len(indices) < 2:
            return  # one GPU or CPU workers: every recompute runs on the same GPU model
        gpus = sorted(i for i in indices if i is not None)
        props = [torch.cuda.get_device_properties(i) for i in gpus]
        models = sorted({(str(p.name), int(p.multi_processor_count)) for p in props})
        if len({sm for _, sm in models}) > 1:
            warnings.warn(
                f"the device pool mixes GPUs with different SM counts ({models}): a "
                "recompute on another GPU than its forward draws different random numbers "
                "(dropout masks), so gradients of random layers are not those of the "
                "forward. Use GPUs of one model, or models without dropout in training, "
                "or pass devices= with one GPU model only",
                RuntimeWarning,
                stacklevel=3,
            )

    def memory_capacity(self) -> int:
        """Bytes of the smallest device (the planner's default limit is 60% of it)."""
        return min(w.memory_capacity() for w in self.workers)

    def submit(
        self, queues: list[list[Any]], run_queue: Callable[[Worker, list[Any]], None]
    ) -> list[Future]:
        """Queue ``run_queue(worker, queue)`` on every worker that has jobs, without
        waiting; the futures. A later call's queues start on a worker as soon as it is
        done with the earlier ones (pipelined iterations)."""
        if self._closed:
            raise RuntimeError("this RoundPipe's device pool is closed; create a new RoundPipe")
        if self.cpu_concurrent:
            # the caller's intra-op threads for a stage alone, an equal share for each busy
            # CPU worker beside others; one with no other CPU worker busy in this
            # submission computes alone: nothing to overlap, and alone its stages are
            # seeded as on a pool without the switch (another thread drawing stops nothing)
            full = torch.get_num_threads()
            busy = [w for w, q in zip(self.workers, queues) if q and w.kind == "cpu"]
            for w in busy:
                w.full_threads = full  # type: ignore[attr-defined]
                w.shared_threads = max(1, full // len(busy))  # type: ignore[attr-defined]
                w.has_siblings = len(busy) > 1  # type: ignore[attr-defined]
        return [
            worker.submit(_run_then_finish, run_queue, worker, q)
            for worker, q in zip(self.workers, queues)
            if q
        ]

    def run(self, queues: list[list[Any]], run_queue: Callable[[Worker, list[Any]], None]) -> None:
        """:meth:`submit`, then wait for all; raise the first failure that is not a
        ``PoolError`` (a job that only stopped because another failed)."""
        futures = self.submit(queues, run_queue)
        wait(futures)
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            primary = [e for e in errors if not isinstance(e, PoolError)]
            raise (primary or errors)[0]

    def close(self) -> bool:
        """Stop every worker thread after its queued jobs and let each device finish its
        copies (idempotent); whether every worker ``drained``."""
        if not self._closed:
            self._closed = True
            for w in self.workers:
                w.close()
        return all(w.drained for w in self.workers)

    def synchronize(self) -> bool:
        """Wait until every device of an open pool has finished the work issued on it
        (a pool shared by several RoundPipes stays open when one of them closes).
        Returns False when a device could not be synchronised."""
        if self._closed:
            return self.close()
        ok = True
        for w in self.workers:
            try:
                w.synchronize()
            except Exception:  # noqa: BLE001 - reported as "not drained"
                ok = False
        return ok


def _run_then_finish(
    run_queue: Callable[[Worker, list[Any]], None], worker: Worker, queue: list[Any]
) -> None:
    """A worker's queue, then the downloads it deferred (after a failed queue too, whose
    own error is raised): whoever waits on its future reads complete results."""
    try:
        run_queue(worker, queue)
    except BaseException:
        with contextlib.suppress(Exception):
            worker.finish_lazy_downloads()
        raise
    worker.finish_lazy_downloads()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_live_pools):
        pool.close()
