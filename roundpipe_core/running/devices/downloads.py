"""Device -> host downloads of a CUDA worker through page-locked memory it reuses.

Two buffers per worker, both allocated once (the staging buffer grows to the
largest piece, never beyond ``staging_bytes`` plus alignment):

- the *staging buffer*: each download is cut into pieces of at most
  ``staging_bytes`` (:func:`~roundpipe_core.running.devices.feeder.plan_chunks`);
  a piece lands there by DMA and is then copied into ordinary (pageable) host
  tensors. All but the last piece are waited for while the download is issued;
  the last one when its completion is waited on, or before the next download
  reuses the buffer.
- the *lazy ring*: small downloads the caller needs only later (a microbatch's
  loss) are placed one after another and completed together, when the ring is
  full or the worker's queue ends (``finish_lazy``): the host does not wait for
  them inside every microbatch, so the GPU keeps its next kernels queued.

Fresh pinned tensors per download would not do: PyTorch's pinned allocator rounds
each block up to a power of two and keeps it for the process, and downloaded
gradients live on as the masters' ``.grad``, so up to twice the gradient bytes
would stay page-locked, outside the host-memory budget.

Free of CUDA calls of its own: the worker passes the stream and its seams
(``_new_pinned_buffer``, ``_copy_on``), which the fake-CUDA test double replaces.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .feeder import Piece, plan_chunks

__all__ = ["ALIGN", "DEFAULT_LAZY_BYTES", "DownloadStager", "StagedDownload"]

#: Offsets in the buffers are aligned so that every dtype can view its piece.
ALIGN = 64
#: Size of the lazy ring; downloads larger than a quarter of it are not deferred.
DEFAULT_LAZY_BYTES = 64 * 1024


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagedDownload:
    """Pieces of a download still in page-locked memory: ``synchronize()`` waits for
    their DMA and copies them into the pageable results (once); ``query()`` does so if
    the DMA is done."""

    def __init__(
        self, stager: DownloadStager, event: Any, copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self._stager = stager
        self._event = event
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] | None = copies

    def finish(self, wait: bool = True) -> None:
        """Complete the copy-out; the caller holds the stager's lock. ``wait=False``: the
        caller already waited for a later event on the same stream (stream order)."""
        if self._copies is None:
            return
        if wait and self._event is not None:
            self._event.synchronize()
        with torch.no_grad():
            for dst, staged in self._copies:
                dst.copy_(staged)
        self._copies = None
        if self._stager.staged is self:
            self._stager.staged = None

    def synchronize(self) -> None:
        with self._stager.lock:
            self.finish()

    def query(self) -> bool:
        if self._copies is not None and self._event is not None and not self._event.query():
            return False
        self.synchronize()
        return True


class DownloadStager:
    """The staging buffer and lazy ring of one worker (see the module docstring).

    Args:
        worker: the CUDA worker; its ``_new_pinned_buffer(nbytes)`` and
            ``_copy_on(stream, pairs, non_blocking)`` are used.
        staging_bytes: piece size of a download.
        lazy_bytes: size of the lazy ring.
    """

    def __init__(self, worker: Any, staging_bytes: int, lazy_bytes: int = DEFAULT_LAZY_BYTES):
        self._worker = worker
        self.staging_bytes = staging_bytes
        self.lazy_bytes = lazy_bytes
        self.lock = threading.Lock()
        self.staging: torch.Tensor | None = None
        self.staged: StagedDownload | None = None  # whose last piece the staging buffer holds
        self.ring: torch.Tensor | None = None
        self._ring_used = 0
        self._lazy: list[StagedDownload] = []

    def download(
        self, stream: Any, srcs: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> StagedDownload:
        """Issue ``outs[i] <- srcs[i]`` (contiguous tensors) through the staging buffer."""
        units = plan_chunks(
            [s.numel() for s in srcs], [s.element_size() for s in srcs], self.staging_bytes
        )
        flat_src = [s.reshape(-1) for s in srcs]
        flat_out = [o.view(-1) for o in outs]
        with self.lock:
            staged = StagedDownload(self, None, [])
            for unit in units:
                if self.staged is not None:  # the buffer still holds a piece
                    self.staged.finish()
                size = sum(_aligned((b - a) * flat_src[i].element_size()) for i, a, b in unit)
                if self.staging is None or self.staging.numel() < size:
                    self.staging = None  # let the old block go back to the allocator first
                    self.staging = self._worker._new_pinned_buffer(size)
                staged = self._issue(self.staging, 0, stream, unit, flat_src, flat_out)
                self.staged = staged
            return staged

    def download_lazy(
        self, stream: Any, srcs: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> bool:
        """Issue a small download through the lazy ring; completed by ``finish_lazy``.
        Returns False (nothing issued) when it is too large to defer."""
        need = sum(_aligned(s.numel() * s.element_size()) for s in srcs)
        if need > self.lazy_bytes // 4:
            return False
        unit: list[Piece] = [(i, 0, s.numel()) for i, s in enumerate(srcs) if s.numel()]
        flat_src = [s.reshape(-1) for s in srcs]
        flat_out = [o.view(-1) for o in outs]
        with self.lock:
            if self._ring_used + need > self.lazy_bytes:
                self._finish_lazy()
            if self.ring is None:
                self.ring = self._worker._new_pinned_buffer(self.lazy_bytes)
            self._lazy.append(
                self._issue(self.ring, self._ring_used, stream, unit, flat_src, flat_out)
            )
            self._ring_used += need
        return True

    def finish_lazy(self) -> None:
        """Complete every deferred download (the host waits here, once)."""
        with self.lock:
            self._finish_lazy()

    def _finish_lazy(self) -> None:
        # one host wait: the last deferred download's event implies the earlier ones
        if self._lazy:
            self._lazy[-1].finish()
        for staged in self._lazy[:-1]:
            staged.finish(wait=False)
        self._lazy = []
        self._ring_used = 0

    def _issue(
        self,
        buffer: torch.Tensor,
        base: int,
        stream: Any,
        unit: list[Piece],
        flat_src: list[torch.Tensor],
        flat_out: list[torch.Tensor],
    ) -> StagedDownload:
        """Enqueue one unit of pieces into ``buffer`` from byte ``base``; the lock is held."""
        into, out_of, off = [], [], base
        for i, a, b in unit:
            src = flat_src[i][a:b]
            nbytes = (b - a) * src.element_size()
            view = buffer[off : off + nbytes].view(src.dtype)
            into.append((view, src))
            out_of.append((flat_out[i][a:b], view))
            off += _aligned(nbytes)
        self._worker._copy_on(stream, into, True)
        event = torch.cuda.Event()
        event.record(stream)
        return StagedDownload(self, event, out_of)
