"""Fences for host buffers: a buffer written back to the host (BatchNorm statistics)
must not change under an upload of it that has not read it yet (another worker's
prefetch DMA would read a torn mix; parameters are fenced by weight versions).

An upload that reads host buffers registers, under one lock, the worker's
``param_fence()`` for each; a write-back takes the lock, waits for those fences, then
writes, and an upload issued meanwhile waits for the lock and reads the new values.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from .devices.base import Worker

__all__ = ["reading_buffers", "write_back"]

_LOCK = threading.Lock()
# id(host buffer) -> {id(worker): its latest fence over uploads of that buffer};
# a worker's later fence implies its earlier ones (one stream, issued in order)
_FENCES: dict[int, dict[int, Callable[[], None]]] = {}


@contextlib.contextmanager
def reading_buffers(worker: Worker, buffers: Sequence[torch.Tensor]) -> Iterator[None]:
    """Around issuing uploads that read ``buffers`` (host tensors) on ``worker``."""
    if not buffers:
        yield
        return
    with _LOCK:
        yield
        fence = worker.param_fence()
        for b in buffers:
            _FENCES.setdefault(id(b), {})[id(worker)] = fence


def write_back(buffers: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """``buffers[i].copy_(values[i])`` once every upload issued of them has read them."""
    with _LOCK:
        fences = {id(f): f for b in buffers for f in _FENCES.pop(id(b), {}).values()}
        for fence in fences.values():
            # a fence of a failed upload raises that upload's error, which its own run
            # reports; this write-back only needs the copy to be over
            with contextlib.suppress(Exception):
                fence()
        with torch.no_grad():
            for b, v in zip(buffers, values):
                b.copy_(v)
