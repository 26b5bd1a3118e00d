"""How glibc's ``malloc`` keeps freed host memory, and the one setting RoundPipe changes.

glibc serves allocations of at least its *mmap threshold* (128 KiB at first) with a
mapping of their own, returned to the system when freed. But after the first such
block is freed it raises the threshold to that block's size (up to 32 MiB): from then
on tensors that size come from its heaps and stay resident after ``free``, to be
reused only by allocations that fit the holes. A run that frees and re-makes large
tensors every step -- a sharded rank drops the gradients it sent and re-makes the
reduction's buffers -- then creeps up step by step: measured 1.8x the budget with 2
and 4 sharded ranks (``benchmarks/sharded_memory.py``).

:func:`limit_heap_retention` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``,
what the ``MALLOC_MMAP_THRESHOLD_`` environment variable does at start-up): every
tensor of 64 KiB or more is its own mapping again, and a freed one leaves the
resident set. The price is a page fault per 4 KiB when such a tensor is made
(the kernel hands out zeroed pages), a few milliseconds per 100 MB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

__all__ = ["HEAP_THRESHOLD_ENV", "limit_heap_retention"]

#: glibc's own variable: a run launched with it keeps its value
HEAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
_M_MMAP_THRESHOLD = -3  # <malloc.h>
_lock = threading.Lock()
_applied: int | None = None


def limit_heap_retention(threshold: int = 64 * 1024) -> bool:
    """Serve allocations of ``threshold`` bytes or more with their own mappings, so
    freeing a tensor returns its memory to the system (see the module docstring).

    Does nothing where ``MALLOC_MMAP_THRESHOLD_`` is set (the launch chose), where
    ``ROUNDPIPE_KEEP_MALLOC=1``, or off glibc. Returns whether the setting is in
    effect after the call. Idempotent.
    """
    global _applied
    if os.environ.get(HEAP_THRESHOLD_ENV):
        return True
    if os.environ.get("ROUNDPIPE_KEEP_MALLOC", "").strip() not in ("", "0"):
        return False
    with _lock:
        if _applied == threshold:
            return True
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name)
            mallopt = libc.mallopt
        except (OSError, AttributeError, TypeError):
            return False  # not glibc (musl, macOS): nothing to tune
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        if mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
            return False
        _applied = threshold
        return True
