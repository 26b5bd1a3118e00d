"""The process beside a run's state, for the host-memory budget: its resident set now
(the ``process`` line) and the code its first training step will page in (the
``training code`` line).

The kernels a training step runs -- autograd's backward functions, the optimizer's
element-wise updates, the collectives -- are file-backed pages of torch's libraries
(``libtorch_cpu.so``) that enter the resident set the first time they run. Measured
with CPU workers on torch 2.13 (``RssFile`` before the first step and after three):
28.4 MiB for an fp32 MLP with shared masters, 31.9 MiB for a bf16 one with fp32
masters, 18.2 MiB for a tiny Llama (its preset's trace had run part of it already).
How much of the library a fault maps depends on the page cache: the kernel maps the
cached pages around a faulting one too, so the same two steps of an fp32 MLP grew
``RssFile`` by 11.6 MiB where ``libtorch_cpu.so`` had partly left the cache and by
35.4 MiB right after ``pip install`` wrote the whole file (a fresh environment, as CI's).
A budget made before the process's first step adds :data:`TRAINING_CODE_BYTES` for
them; once a step was queued they are in the resident set, so in ``process``. Clean
file pages the kernel may drop under pressure: they count in the peak RSS, not in
what :func:`~roundpipe_core.running.host_memory.check_host_memory` asks to allocate.
"""

from __future__ import annotations

import os

__all__ = ["TRAINING_CODE_BYTES", "note_training_step", "resident_bytes", "training_code_bytes"]

#: what a process's first training step pages in of torch's code (see the module docstring)
TRAINING_CODE_BYTES = 40 * 2**20
_stepped = False


def note_training_step() -> None:
    """Record that this process queued an optimizer step (its training code is resident)."""
    global _stepped
    _stepped = True


def training_code_bytes() -> int:
    """:data:`TRAINING_CODE_BYTES` until this process's first step, then 0."""
    return 0 if _stepped else TRAINING_CODE_BYTES


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0
