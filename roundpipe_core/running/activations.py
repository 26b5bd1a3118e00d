"""Activations and their gradients between host and device: pytrees whose tensors are
copied through a worker's transfer primitives (``copy_in`` / ``copy_out_deferred``).

What a stage hands on is downloaded *deferred* (``devices/downloads.py``): a worker
that orders its upload after the download (``Worker.reads_pending_downloads``) reads
it as it is; for any other worker it is completed here, just before its copy.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..batch import flatten
from .devices.base import Worker
from .devices.downloads import complete_pending, has_pending

__all__ = [
    "HostOutputs",
    "grads_to_host",
    "to_device",
    "to_host",
]

_TENSOR, _TENSOR_OR_NONE = frozenset({torch.Tensor}), frozenset({torch.Tensor, type(None)})


def _upload(worker: Worker, leaves: list[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """``leaves`` with their tensors copied to ``worker`` in one ``copy_in`` on the
    activation channel, and the copies (to release). Deferred downloads are completed
    first where the worker would read the host memory directly."""
    # plain tensors only (the common stage; a C-level type test): no index to keep
    plain = _TENSOR.issuperset(map(type, leaves))
    idx = [] if plain else [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = leaves if plain else [leaves[i] for i in idx]
    if not tensors:
        return list(leaves), []
    if not worker.reads_pending_downloads and has_pending():
        complete_pending(tensors)
    dev = worker.copy_in(tensors, "activation")
    if plain:
        return dev, dev
    new = list(leaves)
    for i, t in zip(idx, dev):
        new[i] = t
    return new, dev


def to_device(worker: Worker, *values: Any) -> tuple[Any, ...]:
    """``values`` (pytrees: a stage input, its label or its output gradients) with their
    tensors copied to ``worker`` in one copy, then the copies (to release)."""
    if _TENSOR_OR_NONE.issuperset(map(type, values)):  # no tree to walk
        new, dev = _upload(worker, list(values))
        return (*new, dev)
    trees = [flatten(v) for v in values]
    new, dev = _upload(worker, [x for leaves, _ in trees for x in leaves])
    out, pos = [], 0
    for leaves, rebuild in trees:
        out.append(rebuild(new[pos : pos + len(leaves)]))
        pos += len(leaves)
    return (*out, dev)


def to_host(worker: Worker, value: Any, build_later: bool = False) -> Any:
    """``value`` (a pytree) with its tensors copied to the host, detached (a deferred
    download: see the module docstring). A tree whose rebuilding may run code that reads
    its tensors (a dataclass's or a Hugging Face ``ModelOutput``'s ``__post_init__``:
    anything but plain tuples, lists and dicts) gets them completed first -- or, with
    ``build_later`` (a run's outputs, read only after the run), is built when read from
    :class:`HostOutputs`."""
    if isinstance(value, torch.Tensor):
        return worker.copy_out_deferred([value.detach()])[0]
    leaves, rebuild = flatten(value)
    new, host = _download(worker, leaves)
    if host and has_pending() and not _plain_containers(value):
        if build_later:
            return _Unbuilt(new, rebuild)
        complete_pending(host)
    return rebuild(new)


class _Unbuilt:
    """A host tree whose rebuilding reads its tensors: built once they are downloaded."""

    def __init__(self, leaves: list[Any], rebuild: Any) -> None:
        self._leaves = leaves
        self._rebuild = rebuild

    def build(self) -> Any:
        complete_pending(self._leaves)  # no wait after the run: its queues finished them
        return self._rebuild(self._leaves)


class HostOutputs(dict):
    """A run's outputs by microbatch: a value ``to_host(..., build_later=True)`` left
    unbuilt is built when first read (``outputs[mb]``)."""

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        if isinstance(value, _Unbuilt):
            value = value.build()
            super().__setitem__(key, value)
        return value


def _plain_containers(value: Any) -> bool:
    """Whether every container in ``value`` is a plain tuple, list or dict (or a named
    tuple): rebuilding those runs no code of the value's own."""
    kind = type(value)
    if kind in (tuple, list) or (kind.__base__ is tuple and hasattr(kind, "_fields")):
        return all(_plain_containers(v) for v in value)
    if kind in (dict, collections.OrderedDict, collections.defaultdict):
        return all(_plain_containers(v) for v in value.values())
    if isinstance(value, (tuple, list, dict)) or dataclasses.is_dataclass(value):
        return False  # a subclass (ModelOutput is an OrderedDict) or a dataclass
    return kind not in pytree.SUPPORTED_NODES  # a leaf, or a node type registered by someone


def _download(worker: Worker, leaves: list[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """``leaves`` with their tensors downloaded (deferred, detached), and the host tensors."""
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    host = worker.copy_out_deferred([leaves[i].detach() for i in idx]) if idx else []
    new = list(leaves)
    for i, t in zip(idx, host):
        new[i] = t
    return new, host


def grads_to_host(worker: Worker, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Host copies of the gradients present (``None`` stays ``None``; deferred downloads)."""
    if len(grads) == 1:  # a stage with one tensor input: no index bookkeeping
        g = grads[0]
        return [None] if g is None else list(worker.copy_out_deferred([g]))
    return _download(worker, grads)[0]
