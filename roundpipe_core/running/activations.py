"""Activations and their gradients between host and device: pytrees whose tensors are
copied through a worker's transfer primitives (``copy_in`` / ``copy_out``)."""

from __future__ import annotations

from typing import Any

import torch

from ..batch import flatten
from .devices.base import Worker

__all__ = ["grads_to_device", "grads_to_host", "to_device", "to_device_pair", "to_host"]


def to_device(worker: Worker, value: Any) -> tuple[Any, list[torch.Tensor]]:
    """``value`` (a pytree) with its tensors copied to ``worker``, and the copies (to release)."""
    if isinstance(value, torch.Tensor):  # the common activation: no tree to walk
        dev = worker.copy_in([value], "activation")
        return dev[0], dev
    leaves, rebuild = flatten(value)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    dev = worker.copy_in([leaves[i] for i in idx], "activation") if idx else []
    new = list(leaves)
    for i, t in zip(idx, dev):
        new[i] = t
    return rebuild(new), dev


def to_device_pair(worker: Worker, a: Any, b: Any) -> tuple[Any, Any, list[torch.Tensor]]:
    """:func:`to_device` of two pytrees (a stage input and its label) in one copy: both
    on the device, and the copies (to release)."""
    if type(a) is torch.Tensor and type(b) is torch.Tensor:
        dev = worker.copy_in([a, b], "activation")
        return dev[0], dev[1], dev
    leaves_a, rebuild_a = flatten(a)
    leaves_b, rebuild_b = flatten(b)
    leaves = leaves_a + leaves_b
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    dev = worker.copy_in([leaves[i] for i in idx], "activation") if idx else []
    for i, t in zip(idx, dev):
        leaves[i] = t
    n = len(leaves_a)
    return rebuild_a(leaves[:n]), rebuild_b(leaves[n:]), dev


def to_host(worker: Worker, value: Any) -> Any:
    """``value`` (a pytree) with its tensors copied to the host, detached."""
    if isinstance(value, torch.Tensor):
        return worker.copy_out([value.detach()])[0]
    leaves, rebuild = flatten(value)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    host = worker.copy_out([leaves[i].detach() for i in idx]) if idx else []
    new = list(leaves)
    for i, t in zip(idx, host):
        new[i] = t
    return rebuild(new)


def grads_to_host(worker: Worker, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Host copies of the gradients present (``None`` stays ``None``)."""
    if len(grads) == 1:  # a stage with one tensor input: no index bookkeeping
        g = grads[0]
        return [None] if g is None else list(worker.copy_out([g]))
    present = [(i, g) for i, g in enumerate(grads) if g is not None]
    idx = [i for i, _ in present]
    host = worker.copy_out([g for _, g in present]) if present else []
    out: list[torch.Tensor | None] = [None] * len(grads)
    for i, g in zip(idx, host):
        out[i] = g
    return out


def grads_to_device(
    worker: Worker, grads: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """Device copies of the gradients present, and the copies (to release)."""
    if len(grads) == 1:
        g = grads[0]
        if g is None:
            return [None], []
        dev = worker.copy_in([g], "activation")
        return list(dev), dev
    present = [(i, g) for i, g in enumerate(grads) if g is not None]
    idx = [i for i, _ in present]
    dev = worker.copy_in([g for _, g in present], "activation") if present else []
    out: list[torch.Tensor | None] = [None] * len(grads)
    for i, g in zip(idx, dev):
        out[i] = g
    return out, dev
