"""Device memory for the fake-CUDA mode: PyTorch's caching allocator as far as how much
it *reserves*, with a capacity past which an allocation raises ``torch.OutOfMemoryError``.

What it models of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x):

- Sizes round up to 512 bytes. Requests up to 1 MiB come from the *small* pool, whose
  segments are 2 MiB; larger ones from the *large* pool: a request under 10 MiB gets a
  20 MiB segment, a bigger one a segment rounded up to 2 MiB.
- A segment belongs to the stream the allocation was made on (the current stream), and
  its free blocks are handed out again only for that stream and pool: memory a worker's
  parameter stream freed does not serve its compute stream. Blocks are split (the rest
  stays a free block of the segment) and free neighbours are merged again.
- When a new segment would take ``reserved`` past the capacity, every wholly free
  segment (of any stream) is given back first, then the request is retried; only then
  does it raise ``torch.OutOfMemoryError``.
- With ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``, read at the first
  allocation as the real allocator reads it at start-up) the large pool is one segment
  per stream that maps 2 MiB pages as it grows and unmaps freed ones: a stream reserves
  its live large bytes rounded up to a page (fragmentation inside it is not modelled),
  and a page one stream freed serves another. The small pool stays as above.

What it does not model: ``record_stream`` delays (a block is free the moment its storage
dies), ``max_split_size_mb``, garbage-collection thresholds. Allocations are counted when
the worker makes a device tensor (``CUDAWorker._new_device_tensor``: uploads) and for every
new storage an operation makes inside ``CUDAWorker.compute()`` (activations, gradients,
the loss), through a ``TorchDispatchMode``; a storage is freed when nothing holds it any
more (checked at the next allocation).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MiB = 1024**2
_ROUND = 512
_SMALL_REQUEST = 1 * MiB
_SMALL_SEGMENT = 2 * MiB
_MID_REQUEST = 10 * MiB
_LARGE_SEGMENT = 20 * MiB
_PAGE = 2 * MiB


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(eq=False)
class _Segment:
    stream: Any
    small: bool
    size: int
    # (offset, size, in use) in address order
    blocks: list[list[Any]] = field(default_factory=list)

    def free_whole(self) -> bool:
        return len(self.blocks) == 1 and not self.blocks[0][2]


class FakeCachingAllocator:
    """One fake GPU's caching allocator (see the module's docstring)."""

    def __init__(self, capacity: int, expandable: bool | None = None) -> None:
        self.capacity = int(capacity)
        self._expandable = expandable
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self._segments: list[_Segment] = []
        self._expanded: dict[Any, int] = {}  # stream -> live large bytes (expandable)
        self._live: dict[int, tuple[StorageWeakRef, _Segment | None, list[Any]]] = {}
        self._lock = threading.RLock()

    @property
    def expandable(self) -> bool:
        if self._expandable is None:  # the allocator reads its settings once, at first use
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            self._expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
        return self._expandable

    # -- the allocator's verbs ------------------------------------------------------
    def track(self, storage: torch.UntypedStorage, stream: Any) -> None:
        """Count ``storage`` as device memory allocated on ``stream`` (no-op if counted)."""
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes:
            return
        with self._lock:
            self._sweep()
            if ptr in self._live:
                return  # a view, an in-place result: the storage is counted already
            seg, block = self._malloc(nbytes, stream)
            self._live[ptr] = (StorageWeakRef(storage), seg, block)

    def _sweep(self) -> None:
        dead = [ptr for ptr, (ref, _, _) in self._live.items() if ref.expired()]
        for ptr in dead:
            _, seg, block = self._live.pop(ptr)
            self._free(seg, block)

    def _grow(self, stream: Any, size: int) -> int:
        """Reserved bytes an expandable stream segment adds to hold ``size`` more."""
        live = self._expanded.get(stream, 0)
        return _round_up(live + size, _PAGE) - _round_up(live, _PAGE)

    def _malloc(self, nbytes: int, stream: Any) -> tuple[_Segment | None, list[Any]]:
        size = _round_up(nbytes, _ROUND)
        small = size <= _SMALL_REQUEST
        if not small and self.expandable:
            grow = self._grow(stream, size)
            if self.reserved + grow > self.capacity:
                self._release_free_segments()
            self._check_room(nbytes, grow)
            self._expanded[stream] = self._expanded.get(stream, 0) + size
            self._account(grow, size)
            return None, [stream, size, True]
        found = self._best_fit(size, stream, small)
        if found is None:
            seg_size = self._segment_size(size, small)
            if self.reserved + seg_size > self.capacity:
                self._release_free_segments()
            self._check_room(nbytes, seg_size)
            seg = _Segment(stream, small, seg_size, [[0, seg_size, False]])
            self._segments.append(seg)
            self._account(seg_size, 0)
            found = (seg, 0)
        seg, i = found
        block = seg.blocks[i]
        rest = block[1] - size
        if rest >= (_ROUND if small else _SMALL_REQUEST + 1):  # PyTorch's split rule
            seg.blocks.insert(i + 1, [block[0] + size, rest, False])
            block[1] = size
        block[2] = True
        self._account(0, block[1])
        return seg, block

    def _check_room(self, nbytes: int, more: int) -> None:
        if self.reserved + more > self.capacity:
            raise torch.OutOfMemoryError(
                f"fake CUDA out of memory: tried to allocate {nbytes / MiB:.2f} MiB "
                f"({more / MiB:.2f} MiB more reserved); {self.capacity / MiB:.2f} MiB total "
                f"capacity, {self.allocated / MiB:.2f} MiB allocated, "
                f"{self.reserved / MiB:.2f} MiB reserved by the caching allocator"
            )

    def _account(self, reserved: int, allocated: int) -> None:
        self.reserved += reserved
        self.allocated += allocated
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _segment_size(self, size: int, small: bool) -> int:
        if small:
            return _SMALL_SEGMENT
        return _LARGE_SEGMENT if size < _MID_REQUEST else _round_up(size, _PAGE)

    def _best_fit(self, size: int, stream: Any, small: bool) -> tuple[_Segment, int] | None:
        best: tuple[_Segment, int] | None = None
        best_size = None
        for seg in self._segments:
            if seg.small != small or seg.stream is not stream:
                continue
            for i, (_, bsize, used) in enumerate(seg.blocks):
                if not used and bsize >= size and (best_size is None or bsize < best_size):
                    best, best_size = (seg, i), bsize
        return best

    def _free(self, seg: _Segment | None, block: list[Any]) -> None:
        if seg is None:  # an expandable stream segment: its freed pages are unmapped
            stream, size, _ = block
            live = self._expanded[stream]
            self._expanded[stream] = live - size
            self.reserved -= _round_up(live, _PAGE) - _round_up(live - size, _PAGE)
            self.allocated -= size
            return
        block[2] = False
        self.allocated -= block[1]
        blocks = seg.blocks
        i = next(k for k, b in enumerate(blocks) if b is block)
        if i + 1 < len(blocks) and not blocks[i + 1][2]:  # merge with the next free block
            block[1] += blocks.pop(i + 1)[1]
        if i > 0 and not blocks[i - 1][2]:  # and with the previous one
            blocks[i - 1][1] += blocks.pop(i)[1]

    def _release_free_segments(self) -> None:
        """What the allocator does before an OOM: ``cudaFree`` every wholly free segment."""
        self._sweep()
        keep = []
        for seg in self._segments:
            if seg.free_whole():
                self.reserved -= seg.size
            else:
                keep.append(seg)
        self._segments = keep

    def snapshot(self) -> dict[str, int]:
        """``reserved`` / ``allocated`` now and at their peaks, after freeing dead storages."""
        with self._lock:
            self._sweep()
            return {
                "reserved": self.reserved,
                "allocated": self.allocated,
                "peak_reserved": self.peak_reserved,
                "peak_allocated": self.peak_allocated,
            }


class _CurrentStream(threading.local):
    stream: Any = None
    host_side: int = 0  # > 0: what runs now makes host tensors (downloads, fake snapshots)


CURRENT = _CurrentStream()


class DeviceAllocations(TorchDispatchMode):
    """Counts each new storage an operation makes as an allocation on the current stream
    (entered by the fake worker's ``compute()`` while a ``FakeCachingAllocator`` is on)."""

    def __init__(self, allocator: FakeCachingAllocator) -> None:
        super().__init__()
        self.allocator = allocator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if CURRENT.host_side:
            return out
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            # a view or an in-place / out= result lives in an input's storage: no allocation
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.allocator.track(t.untyped_storage(), CURRENT.stream)
        return out


class host_side:  # noqa: N801 - used like a context-manager function
    """Allocations made inside are host memory (a download's result, a test snapshot)."""

    def __enter__(self) -> None:
        CURRENT.host_side += 1

    def __exit__(self, *exc: object) -> None:
        CURRENT.host_side -= 1
