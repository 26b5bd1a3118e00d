"""Device -> host downloads of a CUDA worker through page-locked memory it reuses
(docs/architecture.md, "Two backends", says when each kind of download is finished).

Two buffers per worker, both allocated once: the *staging ring* (``staging_bytes``),
into which a download is cut in pieces (``feeder.plan_chunks``) that are copied into
pageable host tensors when finished; the host waits only when the ring comes round to
memory an unfinished piece (or an upload reading one, ``read_pending``) still holds.
Until finished, a piece keeps its device sources referenced, so their memory is not
handed out while the DMA may still read it. The *lazy ring* takes small downloads read
only after the queue (a microbatch's loss), completed together.

Fresh pinned tensors per download would not do: PyTorch's pinned allocator rounds each
block up to a power of two and keeps it for the process, and downloaded gradients live
on as the masters' ``.grad``: up to twice the gradient bytes would stay page-locked,
outside the host-memory budget.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .feeder import Piece, plan_chunks
from .memory import next_pow2

__all__ = [
    "ALIGN",
    "DEFAULT_LAZY_BYTES",
    "Download",
    "DownloadStager",
    "StagedDownload",
    "complete_pending",
    "has_pending",
    "read_pending",
]

#: Offsets in the buffers are aligned so that every dtype can view its piece.
ALIGN = 64
#: Size of the lazy ring; downloads larger than a quarter of it are not deferred.
DEFAULT_LAZY_BYTES = 64 * 1024

# Host tensors a deferred download has not filled yet, by the address of their data:
# address -> (the host tensor, [(first element, end element, pinned view, piece)]).
# One lock for every worker's entries: an upload on one worker reads what another
# worker's download left in its ring.
_PENDING: dict[int, tuple[torch.Tensor, list[tuple[int, int, torch.Tensor, StagedDownload]]]] = {}
_PENDING_LOCK = threading.Lock()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagedDownload:
    """One piece of a download in page-locked memory: ``finish()`` waits for its DMA and
    copies it into the pageable results (once); until then it holds the device
    ``sources``. ``readers``: events of uploads that copy straight from the piece."""

    def __init__(
        self,
        stager: DownloadStager,
        event: Any,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        pieces: list[tuple[int, int, int, torch.Tensor]],
    ) -> None:
        self._stager = stager
        self.event = event
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] | None = copies
        self.pieces = pieces  # (tensor index, first element, end element, pinned view)
        self.sources: Sequence[torch.Tensor] = ()
        self.span = (0, 0)  # its bytes in the staging ring
        self.readers: list[Any] = []
        self.registered: list[int] = []  # _PENDING keys that point at this piece

    @property
    def finished(self) -> bool:
        return self._copies is None

    def dma_done(self) -> bool:
        return self.event is None or self.event.query()

    def finish(self, wait: bool = True) -> None:
        """Complete the copy-out (stager lock held; ``wait=False``: a later event on the
        stream was waited for). A wait that raises still marks the piece finished: the
        error goes to whoever finished it and the ring stays usable (the piece keeps its
        device sources until its memory is reused: the DMA's state is unknown)."""
        copies = self._copies
        if copies is None:
            return
        try:
            if wait and self.event is not None and not self.event.query():
                self.event.synchronize()
            with torch.no_grad():
                for dst, staged in copies:
                    dst.copy_(staged)
            self.sources = ()  # the DMA is done: the device memory may be reused
        finally:
            self._copies = None
            with _PENDING_LOCK:  # readers now find these host elements filled
                for key in self.registered:
                    got = _PENDING.get(key)
                    if got is not None and all(p.finished for *_, p in got[1]):
                        del _PENDING[key]
                self.registered = []

    def synchronize(self) -> None:
        with self._stager.lock:
            self.finish()


class Download:
    """The pieces of one download: ``synchronize()`` completes the host tensors (one host
    wait at most: the last piece's event implies the earlier ones'); ``query()`` does so
    if the DMA is done."""

    def __init__(self, stager: DownloadStager, parts: list[StagedDownload]) -> None:
        self._stager = stager
        self._parts = parts

    def synchronize(self) -> None:
        with self._stager.lock:
            self._stager.finish_parts(self._parts)

    def query(self) -> bool:
        if not all(p.finished or p.dma_done() for p in self._parts):
            return False
        self.synchronize()
        return True


class DownloadStager:
    """The staging ring (``staging_bytes``, the largest piece) and lazy ring
    (``lazy_bytes``) of a CUDA ``worker``, through its seams ``_new_pinned_buffer`` and
    ``_copy_on`` (which the fake-CUDA test double replaces)."""

    def __init__(self, worker: Any, staging_bytes: int, lazy_bytes: int = DEFAULT_LAZY_BYTES):
        self._worker = worker
        self.staging_bytes = staging_bytes
        self.lazy_bytes = lazy_bytes
        self.lock = threading.Lock()
        self.staging: torch.Tensor | None = None  # the staging ring
        self._head = 0  # where the next piece goes
        self._slots: list[StagedDownload] = []  # pieces holding ring memory, oldest first
        self.ring: torch.Tensor | None = None  # the lazy ring
        self._ring_used = 0
        self._lazy: list[StagedDownload] = []

    def pinned_bytes(self) -> int:
        """Page-locked bytes of both rings once allocated (each block rounded up to a power
        of two, as PyTorch's pinned allocator does)."""
        return sum(next_pow2(n) for n in (_aligned(self.staging_bytes), self.lazy_bytes))

    # -- the staging ring ------------------------------------------------------------
    def download(
        self,
        stream: Any,
        srcs: list[torch.Tensor],
        outs: list[torch.Tensor],
        deferred: bool = False,
    ) -> Download:
        """Issue ``outs[i] <- srcs[i]`` (contiguous tensors) through the staging ring.
        ``deferred``: the host tensors are registered as pending (``read_pending``,
        ``complete_pending``) until a reader or ``finish_all`` finishes them."""
        cap = _aligned(self.staging_bytes)
        units = []
        for unit in plan_chunks(
            [s.numel() for s in srcs], [s.element_size() for s in srcs], self.staging_bytes
        ):
            if self._unit_bytes(unit, srcs) <= cap:
                units.append(unit)
            else:  # alignment pushed a unit of several pieces past the ring: one each
                units.extend([piece] for piece in unit)
        parts: list[StagedDownload] = []
        with self.lock:
            if self.staging is None:
                self.staging = self._worker._new_pinned_buffer(cap)
            self._prune()
            for unit in units:
                size = self._unit_bytes(unit, srcs)
                start = self._place(size)
                part = self._issue(self.staging, start, stream, unit, srcs, outs)
                part.sources, part.span = srcs, (start, start + size)
                self._slots.append(part)
                parts.append(part)
            if deferred and not parts[-1].finished:
                self._register(parts, outs)
        return Download(self, parts)

    @staticmethod
    def _unit_bytes(unit: list[Piece], srcs: list[torch.Tensor]) -> int:
        return sum(_aligned((b - a) * srcs[i].element_size()) for i, a, b in unit)

    def _place(self, size: int) -> int:
        """Where the next ``size`` bytes go (after the last piece, or from the ring's start),
        retiring the pieces still there first (lock held)."""
        assert self.staging is not None
        if self._head + size > self.staging.numel():
            self._head = 0
        start, end = self._head, self._head + size
        overlapping = [s for s in self._slots if s.span[0] < end and start < s.span[1]]
        if overlapping:
            self._retire(overlapping)
        self._head = end
        return start

    def _retire(self, slots: list[StagedDownload]) -> None:
        """Free the ring memory of ``slots`` (in issue order): finish them (one host wait,
        for the newest unfinished one) and wait for the uploads that read them."""
        self.finish_parts(slots)
        for slot in slots:
            with _PENDING_LOCK:
                readers, slot.readers = slot.readers, []
            for event in readers:
                if not event.query():
                    event.synchronize()
            slot.sources = ()
            self._slots.remove(slot)

    def _prune(self) -> None:
        """Finish the pieces whose DMA is done (no host wait; their device sources let go
        early) and forget those no upload reads any more (lock held)."""
        landed = True
        keep: list[StagedDownload] = []
        for slot in self._slots:
            if not slot.finished and landed and slot.dma_done():
                slot.finish(wait=False)
            landed = landed and slot.finished  # one stream: later pieces land later
            if slot.finished:
                with _PENDING_LOCK:
                    slot.readers = [r for r in slot.readers if not r.query()]
                    if not slot.readers:
                        continue
            keep.append(slot)
        self._slots = keep

    def finish_parts(self, parts: list[StagedDownload]) -> None:
        """Finish ``parts`` (pieces of this ring, in issue order): one host wait, on the
        newest unfinished one, covers the others (one download stream). Lock held."""
        unfinished = [p for p in parts if not p.finished]
        if not unfinished:
            return
        try:
            unfinished[-1].finish()
        finally:
            for part in unfinished[:-1]:
                part.finish(wait=False)

    def finish_all(self) -> None:
        """Complete every download of both rings (the queue ended: one host wait per ring)."""
        with self.lock:
            try:
                self.finish_parts(self._slots)
            finally:
                self._finish_lazy()

    def _register(self, parts: list[StagedDownload], outs: list[torch.Tensor]) -> None:
        """Enter the pending host tensors of a deferred download (stager lock held)."""
        pieces: dict[int, list[tuple[int, int, torch.Tensor, StagedDownload]]] = {}
        for part in parts:  # finished ones too: their elements are read from the host
            for i, a, b, view in part.pieces:
                pieces.setdefault(i, []).append((a, b, view, part))
        with _PENDING_LOCK:
            for i, entries in pieces.items():
                if all(part.finished for *_, part in entries):
                    continue  # its pieces were retired while the later ones were placed
                key = outs[i].data_ptr()
                _PENDING[key] = (outs[i], entries)
                for *_, part in entries:
                    part.registered.append(key)

    # -- the lazy ring -----------------------------------------------------------
    def download_lazy(
        self, stream: Any, srcs: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> bool:
        """Issue a small download through the lazy ring; completed by ``finish_lazy``.
        Returns False (nothing issued) when it is too large to defer."""
        need = sum(_aligned(s.numel() * s.element_size()) for s in srcs)
        if need > self.lazy_bytes // 4:
            return False
        unit: list[Piece] = [(i, 0, s.numel()) for i, s in enumerate(srcs) if s.numel()]
        with self.lock:
            if self._ring_used + need > self.lazy_bytes:
                self._finish_lazy()
            if self.ring is None:
                self.ring = self._worker._new_pinned_buffer(self.lazy_bytes)
            part = self._issue(self.ring, self._ring_used, stream, unit, srcs, outs)
            part.sources = srcs
            self._lazy.append(part)
            self._ring_used += need
        return True

    def _finish_lazy(self) -> None:
        lazy, self._lazy, self._ring_used = self._lazy, [], 0
        self.finish_parts(lazy)

    def _issue(
        self,
        buffer: torch.Tensor,
        base: int,
        stream: Any,
        unit: list[Piece],
        srcs: list[torch.Tensor],
        outs: list[torch.Tensor],
    ) -> StagedDownload:
        """Enqueue one unit of pieces (elements of the flattened tensors) into ``buffer``
        from byte ``base``; the lock is held."""
        into, out_of, off, pieces = [], [], base, []
        for i, a, b in unit:
            src = srcs[i].reshape(-1)[a:b]
            nbytes = (b - a) * src.element_size()
            view = buffer[off : off + nbytes].view(src.dtype)
            into.append((view, src))
            out_of.append((outs[i].view(-1)[a:b], view))
            pieces.append((i, a, b, view))
            off += _aligned(nbytes)
        self._worker._copy_on(stream, into)
        event = torch.cuda.Event()
        event.record(stream)
        return StagedDownload(self, event, out_of, pieces)


def has_pending() -> bool:
    """Whether any deferred download is unfinished (cheap)."""
    return bool(_PENDING)


def _entry(t: torch.Tensor) -> list[tuple[int, int, torch.Tensor, StagedDownload]] | None:
    """The pending pieces of host tensor ``t`` (``_PENDING_LOCK`` held), or None."""
    if not t.numel() or t.is_cuda:
        return None
    got = _PENDING.get(t.data_ptr())
    if got is None:
        return None
    host, entries = got
    if t.shape != host.shape or t.stride() != host.stride() or t.dtype != host.dtype:
        return None  # another view of that memory: complete_pending handles it
    return entries


@contextlib.contextmanager
def read_pending(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> Iterator[tuple[list[tuple[torch.Tensor, torch.Tensor]], list[StagedDownload]]]:
    """For an upload's ``(device destination, host source)`` pairs: the pairs to copy,
    each pending host source replaced by the pinned pieces it is in, and those pieces
    (the upload's stream waits on their events; their ``readers`` get its event). Issue
    the copies and register the event inside the context: pieces are not finished or
    reused while it is open. Another view of a pending tensor's memory is completed on
    the host first."""
    if _PENDING:
        complete_pending([src for _, src in pairs], views_only=True)
    with _PENDING_LOCK:
        if not _PENDING:
            yield list(pairs), []
            return
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        parts: list[StagedDownload] = []
        for dst, src in pairs:
            entries = _entry(src)
            if entries is None:
                out.append((dst, src))
                continue
            flat = dst.view(-1)
            host = src.reshape(-1)
            for a, b, view, part in entries:
                if part.finished:  # an earlier piece, retired already: on the host
                    out.append((flat[a:b], host[a:b]))
                    continue
                out.append((flat[a:b], view))
                if not any(p is part for p in parts):
                    parts.append(part)
        yield out, parts


def complete_pending(tensors: Sequence[Any], views_only: bool = False) -> None:
    """Fill the host tensors among ``tensors`` a deferred download still owes, before the
    host reads them (``views_only``: only other views of a pending tensor's memory)."""
    if not _PENDING:
        return
    todo: list[StagedDownload] = []
    with _PENDING_LOCK:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.numel() or t.is_cuda:
                continue
            # a pending host tensor is a storage of its own: its views share the address
            got = _PENDING.get(t.untyped_storage().data_ptr())
            if got is None or (views_only and _entry(t) is not None):
                continue
            for *_, part in got[1]:
                if not part.finished and not any(p is part for p in todo):
                    todo.append(part)
    for part in todo:
        part.synchronize()
