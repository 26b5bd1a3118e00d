"""How glibc's ``malloc`` keeps freed host memory, and the setting that makes a sharded
run's peak what the host-memory budget predicts.

glibc serves allocations of at least its *mmap threshold* (128 KiB at first) with a
mapping of their own, returned to the system when freed. But after the first such
block is freed it raises the threshold to that block's size (up to 32 MiB): from then
on tensors that size come from its heaps and stay resident after ``free``, to be
reused only by allocations that fit the holes. A run that frees and re-makes large
tensors every step -- a sharded rank drops the gradients it sent -- keeps some of them:
the sharded collectives keep their flat buffers for that reason (a 25 MiB bucket made
and freed every step lifted the threshold above every gradient: 1.14-1.25x the
whole-process prediction with 2 and 4 ranks); with them kept, a sharded rank peaks at
1.02-1.03x the prediction (fp32; a bf16 model up to 1.10x; ``benchmarks/sharded_memory.py``).

:func:`limit_heap_retention` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``,
what the ``MALLOC_MMAP_THRESHOLD_`` environment variable does at start-up): every
tensor of 64 KiB or more is its own mapping again, and a freed one leaves the
resident set (measured: 0.98-1.01x the prediction). The price is a page fault per
4 KiB whenever such a tensor is made (the kernel hands out zeroed pages, and freeing
unmaps them): on CPU workers, whose every gradient and temporary is host memory, the
same benchmark's steps took 1.1-3x as long (1.5-2x also with a 1 or 4 MiB threshold). So
RoundPipe does not set it on its own: a memory-bound sharded run opts in, at launch
(``MALLOC_MMAP_THRESHOLD_=65536``) or with :func:`limit_heap_retention`, and
``DataParallel(shard_host_state=True)`` says so once (INFO) when neither was done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

__all__ = ["HEAP_THRESHOLD_ENV", "heap_retention_limited", "limit_heap_retention"]

#: glibc's own variable: a run launched with it keeps its value
HEAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
_M_MMAP_THRESHOLD = -3  # <malloc.h>
_lock = threading.Lock()
_applied: int | None = None


def limit_heap_retention(threshold: int = 64 * 1024) -> bool:
    """Serve allocations of ``threshold`` bytes or more with their own mappings, so
    freeing a tensor returns its memory to the system (see the module docstring).

    Process-wide and for the rest of the process. Does nothing where
    ``MALLOC_MMAP_THRESHOLD_`` is set (the launch chose) or off glibc. Returns whether
    the setting is in effect after the call. Idempotent.
    """
    global _applied
    if os.environ.get(HEAP_THRESHOLD_ENV):
        return True
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


def heap_retention_limited() -> bool:
    """Whether the mmap threshold is fixed (at launch, or by :func:`limit_heap_retention`)."""
    return bool(os.environ.get(HEAP_THRESHOLD_ENV)) or _applied is not None
