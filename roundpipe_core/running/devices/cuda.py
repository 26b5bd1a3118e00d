"""CUDA backend: one controller thread per GPU, four streams (``param``, chunked by a
feeder; ``activation``; ``compute``; ``download``, through ``downloads.py``'s rings),
ordered by CUDA events, not host waits. See docs/architecture.md, "Two backends".

A device tensor made by ``copy_in`` is allocated on its channel's stream and marked
``record_stream(compute)``, so the caching allocator does not reuse its memory before
the compute issued until it is freed has finished. Host sources must not change until
their upload has read them (``param_fence``): the optimizer rewrites weights the next
iteration may be prefetching. Every copy goes through ``_copy_on`` and every host
buffer through ``_new_host_tensor``: the test double of this worker (tests/conftest.py)
runs those copies late, so a missing wait shows up as wrong data on a CPU.

This module imports on machines without CUDA; only constructing a worker needs a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .base import Worker, _noop
from .downloads import DownloadStager, read_pending
from .feeder import ChunkFeeder, Piece, plan_chunks
from .memory import ReusedHostTensors, allocator_reserve_bytes, cuda_available

__all__ = [
    "CUDAWorker",
    "DEFAULT_PARAM_CHUNK_BYTES",
    "DEFAULT_PARAM_INFLIGHT_CHUNKS",
]

PARAM = "param"
ACTIVATION = "activation"
CHANNELS = (PARAM, ACTIVATION)

#: Size of one parameter-upload piece; env ROUNDPIPE_PARAM_CHUNK_MB overrides.
DEFAULT_PARAM_CHUNK_BYTES = 32 * 1024**2
#: Size of each worker's pinned download staging ring; env ROUNDPIPE_DOWNLOAD_STAGING_MB.
DEFAULT_DOWNLOAD_STAGING_BYTES = 64 * 1024**2
#: Parameter pieces queued on the GPU at once; 0 issues every piece at once
#: (no feeder thread). Env ROUNDPIPE_PARAM_INFLIGHT overrides.
DEFAULT_PARAM_INFLIGHT_CHUNKS = 2

# Workers sharing one GPU (tests put several on one device) share its random
# generator; their compute is serialised so that each stage's RNG state is
# well defined, as on the CPU backend. One worker per GPU takes no lock.
_DEVICE_LOCKS: dict[int, threading.RLock] = collections.defaultdict(threading.RLock)
_DEVICE_USERS: collections.Counter[int] = collections.Counter()
_REGISTRY_LOCK = threading.Lock()


# argument: (its environment variable, default, least value); a variable ending in _MB
# gives MiB
_SETTINGS = {
    "download_staging_bytes": ("ROUNDPIPE_DOWNLOAD_STAGING_MB", DEFAULT_DOWNLOAD_STAGING_BYTES, 1),
    "param_chunk_bytes": ("ROUNDPIPE_PARAM_CHUNK_MB", DEFAULT_PARAM_CHUNK_BYTES, 1),
    "param_inflight_chunks": ("ROUNDPIPE_PARAM_INFLIGHT", DEFAULT_PARAM_INFLIGHT_CHUNKS, 0),
}


def _setting(name: str, value: int | None) -> int:
    """Argument ``name``: ``value``, else its environment variable, else its default
    (``ValueError`` for a variable that is not a number, or a value below the least)."""
    env, default, least = _SETTINGS[name]
    if value is None:
        raw = os.environ.get(env) or ""
        try:
            value = int(float(raw)) * (1024**2 if env.endswith("_MB") else 1) if raw else default
        except ValueError as exc:
            raise ValueError(f"environment variable {env}={raw!r} must be a number") from exc
    if value < least:
        raise ValueError(f"{name} ({env}) must be >= {least}, got {value}")
    return value


def _mark_used_by(t: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator that ``stream`` uses ``t``: its memory is not handed
    out again after ``t`` is freed until the work queued on ``stream`` by then is done."""
    if t.is_cuda and t.numel():
        t.record_stream(stream)


def _check_cuda_device(device: torch.device | str | int) -> torch.device:
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CUDAWorker needs a cuda device, got {device}; use CPUWorker for 'cpu'")
    if not cuda_available():
        raise ValueError(
            f"device {device} was requested but CUDA is not available on this machine; "
            "pass devices=None or 'cpu:N' to run on CPU workers"
        )
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if not 0 <= index < count:
        raise ValueError(
            f"device {device} does not exist: {count} GPU(s) are visible "
            f"(cuda:0..cuda:{count - 1}); check CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", index)


class CUDAWorker(Worker):
    """A GPU driven by one controller thread (see the module docstring).

    Args:
        index: the worker's position in the pool.
        device: its GPU (``torch.device("cuda", i)``); several workers may share one GPU.
        param_chunk_bytes: piece size of parameter uploads.
        param_inflight_chunks: pieces queued at once on the parameter stream
            (0 = no feeder: issue a whole upload at once).
        download_staging_bytes: size of the pinned staging ring downloads go through
            (``downloads.py``); larger downloads go through it in pieces.
    """

    kind = "cuda"
    draws_from_host_generator = False  # the GPU's generator; CPU draws are not replayed
    reads_pending_downloads = True  # copy_in waits on a deferred download's event

    def __init__(
        self,
        index: int,
        device: torch.device | str | int,
        param_chunk_bytes: int | None = None,
        param_inflight_chunks: int | None = None,
        download_staging_bytes: int | None = None,
    ) -> None:
        device = _check_cuda_device(device)
        self.download_staging_bytes = _setting("download_staging_bytes", download_staging_bytes)
        self._downloads = DownloadStager(self, self.download_staging_bytes)
        # parameter gradients land in memory written before (see ReusedHostTensors)
        self._gradient_results = ReusedHostTensors()
        self.param_chunk_bytes = _setting("param_chunk_bytes", param_chunk_bytes)
        depth = _setting("param_inflight_chunks", param_inflight_chunks)
        with torch.cuda.device(device):
            # Lower number = higher priority; out-of-range values are clamped by PyTorch.
            self.param_stream = torch.cuda.Stream(device, priority=0)
            self.activation_stream = torch.cuda.Stream(device, priority=-1)
            self.compute_stream = torch.cuda.Stream(device, priority=0)
            self.download_stream = torch.cuda.Stream(device, priority=0)
        self._streams = {PARAM: self.param_stream, ACTIVATION: self.activation_stream}
        # Last event recorded on each upload channel (activation; param without a feeder).
        self._events: dict[str, torch.cuda.Event | None] = {PARAM: None, ACTIVATION: None}
        self._event_lock = threading.Lock()
        self._feeder = (
            ChunkFeeder(
                f"roundpipe-cuda-{index}-param", depth, lambda: torch.cuda.set_device(device)
            )
            if depth > 0
            else None
        )
        self.gpu_index: int = device.index
        with _REGISTRY_LOCK:
            _DEVICE_USERS[self.gpu_index] += 1
            self._device_lock = _DEVICE_LOCKS[self.gpu_index]
        super().__init__(index, device)

    # -- thread -------------------------------------------------------------
    def _thread_init(self) -> None:
        torch.cuda.set_device(self.device)
        # Code the runtime runs on this thread outside compute() also lands on compute.
        torch.cuda.set_stream(self.compute_stream)

    def close(self, timeout: float = 10.0) -> None:
        """Drain, issue, finish, in that order: the jobs already queued run (an upload
        among them still needs the feeder), the feeder issues what it was given, then
        the GPU finishes every copy. ``drained`` is True only when all three happened,
        so that the caller unregisters or frees host memory under no DMA."""
        if self._closed:
            return
        super().close(timeout)
        feeder_done = self._feeder.close(timeout) if self._feeder is not None else True
        if self.drained and feeder_done:
            try:
                torch.cuda.synchronize(self.device)
                # downloads nobody read (a queue always finishes its own): their host
                # tensors filled, the pending entries and the device sources let go
                self._downloads.finish_all()
            except Exception:  # noqa: BLE001 - a failed device: its copies' state is unknown
                self.drained = False
        else:
            self.drained = False
        with _REGISTRY_LOCK:
            _DEVICE_USERS[self.gpu_index] -= 1

    # -- transfers ----------------------------------------------------------
    def _new_device_tensor(self, like: torch.Tensor) -> torch.Tensor:
        """Uninitialised device memory shaped like ``like`` (a seam for test doubles)."""
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def _new_host_tensor(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised pageable host tensor a download ends in (a seam)."""
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")

    def _new_pinned_buffer(self, nbytes: int) -> torch.Tensor:
        """Uninitialised page-locked bytes: a download ring (a seam)."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)

    def _copy_on(self, stream: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue ``dst.copy_(src)`` for each pair on ``stream`` (the one place copies
        are issued: the test double runs them late). Autograd is off: an upload's
        destination may already be the stage's parameter when the feeder issues it."""
        with torch.cuda.stream(stream), torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def copy_in(self, tensors: Sequence[torch.Tensor], channel: str) -> list[torch.Tensor]:
        if channel not in CHANNELS:
            raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
        stream = self._streams[channel]
        srcs = [t.detach() for t in tensors]
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            # Allocated on the channel's stream: the memory is free for that stream now;
            # record_stream(compute) holds it after free until compute is done with it.
            outs = [self._new_device_tensor(t) for t in srcs]
        for out in outs:
            _mark_used_by(out, self.compute_stream)
            self.ledger.alloc(out.nbytes, channel)
        if channel == PARAM and self._feeder is not None:
            try:
                self._submit_param(srcs, outs)
            except BaseException:
                # the caller never gets these tensors, so it cannot release them
                for out in outs:
                    self.ledger.free(out.nbytes, channel)
                raise
        else:
            pairs = [(o, s) for s, o in zip(srcs, outs) if o.numel()]
            with torch.cuda.device(self.device), read_pending(pairs) as (pairs, pending):
                # a source still owed by a deferred download comes from its pinned piece,
                # after that download's event (on whichever worker it was issued)
                for piece in pending:
                    stream.wait_event(piece.event)
                self._copy_on(stream, pairs)
                ticket = torch.cuda.Event()
                ticket.record(stream)
                for piece in pending:  # not reused before this upload has read it
                    piece.readers.append(ticket)
            with self._event_lock:
                self._events[channel] = ticket
        return outs

    def _submit_param(self, srcs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Cut a parameter upload into units and hand them to the feeder."""
        srcs = [s if s.is_contiguous() else s.contiguous() for s in srcs]
        flat_src = [s.reshape(-1) for s in srcs]
        flat_dst = [o.view(-1) for o in outs]
        units = plan_chunks(
            [s.numel() for s in srcs], [s.element_size() for s in srcs], self.param_chunk_bytes
        )
        stream = self.param_stream

        def make_unit(pieces: list[Piece]) -> Callable[[], torch.cuda.Event]:
            def unit() -> torch.cuda.Event:
                self._copy_on(stream, [(flat_dst[i][a:b], flat_src[i][a:b]) for i, a, b in pieces])
                event = torch.cuda.Event()
                event.record(stream)
                return event

            return unit

        assert self._feeder is not None
        self._feeder.submit([make_unit(p) for p in units])

    def wait_channel(self, channel: str) -> None:
        if channel not in CHANNELS:
            raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
        if channel == PARAM and self._feeder is not None:
            ticket = self._feeder.last_ticket
            event = self._feeder.wait_issued(ticket) if ticket else None
        else:
            with self._event_lock:
                event = self._events[channel]
        if event is not None:
            self.compute_stream.wait_event(event)

    def param_fence(self) -> Callable[[], None]:
        """See ``Worker.param_fence``; callable from another thread (the optimizer's)."""
        feeder = self._feeder
        if feeder is None:
            with self._event_lock:
                event = self._events[PARAM]
            return event.synchronize if event is not None else _noop
        ticket = feeder.last_ticket

        def fence() -> None:
            ev = feeder.wait_issued(ticket, prune=False) if ticket else None
            if ev is not None:
                ev.synchronize()

        return fence

    def copy_out(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        outs, done = self.copy_out_async(tensors)
        done.synchronize()
        return outs

    def take_out(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        outs, done = self.copy_out_async(tensors, self._gradient_results)
        done.synchronize()
        return outs

    def copy_out_lazy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.copy_out_deferred(tensors, lazy=True)

    def copy_out_deferred(
        self, tensors: Sequence[torch.Tensor], lazy: bool = False
    ) -> list[torch.Tensor]:
        """Device -> host through the staging ring (``lazy``: small tensors through the
        lazy ring) without a host wait (``downloads.py``)."""
        srcs, outs = self._begin_download(tensors)
        with torch.cuda.device(self.device):
            if not (lazy and self._downloads.download_lazy(self.download_stream, srcs, outs)):
                self._downloads.download(self.download_stream, srcs, outs, deferred=True)
        return outs

    def finish_lazy_downloads(self) -> None:
        self._downloads.finish_all()

    def pinned_download_bytes(self) -> int:
        return self._downloads.pinned_bytes()

    def copy_out_async(
        self, tensors: Sequence[torch.Tensor], reuse: ReusedHostTensors | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Start device -> host copies after the compute issued so far: (pageable host
        tensors, from ``reuse`` where given, and a completion whose ``synchronize()`` or
        true ``query()`` makes them valid)."""
        srcs, outs = self._begin_download(tensors, reuse)
        with torch.cuda.device(self.device):
            return outs, self._downloads.download(self.download_stream, srcs, outs)

    def _begin_download(
        self, tensors: Sequence[torch.Tensor], reuse: ReusedHostTensors | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Contiguous sources and uninitialised results (from ``reuse`` where given), the
        download stream ordered after the compute issued so far."""
        srcs = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]
        with torch.cuda.device(self.device):
            ready = torch.cuda.Event()
            ready.record(self.compute_stream)
            self.download_stream.wait_event(ready)
        for src in srcs:
            _mark_used_by(src, self.download_stream)
        if reuse is None:
            return srcs, [self._new_host_tensor(src) for src in srcs]
        new = self._new_host_tensor
        return srcs, [reuse.take(src.shape, src.dtype, functools.partial(new, src)) for src in srcs]

    def release(self, tensors: Sequence[torch.Tensor], tag: str) -> None:
        super().release(tensors, tag)
        for t in tensors:
            # Uploads already carry record_stream(compute); this covers device
            # tensors the runtime made itself on another stream.
            _mark_used_by(t, self.compute_stream)

    # -- compute ------------------------------------------------------------
    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        shared = _DEVICE_USERS[self.gpu_index] > 1
        lock = self._device_lock if shared else contextlib.nullcontext()
        with lock, torch.cuda.device(self.device), torch.cuda.stream(self.compute_stream):
            yield

    def get_rng_state(self) -> Any:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: Any) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def time_point(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.compute_stream)
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if not end.query():  # a host wait only while the marker is still ahead of the host
            end.synchronize()
        return float(start.elapsed_time(end))

    def memory_capacity(self) -> int:
        """Bytes this worker may plan for: its GPU's free memory plus what this process
        reserved there, shared evenly by this process's workers on that GPU, less what the
        caching allocator reserves above a plan's bytes (``allocator_reserve_bytes``)."""
        try:
            free, _ = torch.cuda.mem_get_info(self.device)
            available = int(free) + int(torch.cuda.memory_reserved(self.device))
        except Exception:  # noqa: BLE001 - no context yet / query refused: use properties
            available = int(torch.cuda.get_device_properties(self.device).total_memory)
        with _REGISTRY_LOCK:
            sharing = max(_DEVICE_USERS[self.gpu_index], 1)
        return max(available // sharing - allocator_reserve_bytes(), 1)

    def synchronize(self) -> None:
        if self._feeder is not None:
            self._feeder.wait_issued(self._feeder.last_ticket)
        torch.cuda.synchronize(self.device)
