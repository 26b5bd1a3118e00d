"""Thread-local execution context of the layer a worker is running: whether it is being
recomputed (``doing_recompute``), data its forward keeps for the recompute pass
(``save_for_recompute`` / ``get_recompute_data``, e.g. MoE routing), and the caller's
autocast state (``AutocastState``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = [
    "AutocastState",
    "RecomputeStore",
    "current_layer",
    "current_microbatch",
    "doing_recompute",
    "get_recompute_data",
    "LayerFrame",
    "running_layer",
    "save_for_recompute",
    "set_frame",
]

_local = threading.local()


class RecomputeStore:
    """Data saved in the forward of one pipelined call, keyed by (layer, microbatch)."""

    def __init__(self) -> None:
        self._data: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._lock = threading.Lock()

    def put(self, key: tuple[int, int], data: tuple[Any, ...]) -> None:
        with self._lock:
            self._data[key] = data

    def get(self, key: tuple[int, int]) -> tuple[Any, ...]:
        with self._lock:
            if key not in self._data:
                raise RuntimeError(
                    f"get_recompute_data(): layer {key[0]} saved nothing for microbatch {key[1]} "
                    "in its forward; call save_for_recompute(...) in the forward pass"
                )
            return self._data[key]


class LayerFrame:
    """What the running layer's code may ask about: layer, microbatch, recompute or not
    (one frame per stage and microbatch, ``layer`` moved along: :func:`set_frame`)."""

    __slots__ = ("layer", "microbatch", "recompute", "store", "device")

    def __init__(
        self,
        layer: int,
        microbatch: int,
        recompute: bool,
        store: RecomputeStore | None,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.microbatch = microbatch
        self.recompute = recompute
        self.store = store
        self.device = device


def _frame() -> LayerFrame | None:
    return getattr(_local, "frame", None)


def set_frame(frame: LayerFrame | None) -> LayerFrame | None:
    """Make ``frame`` the current thread's frame (engine use); returns the previous one,
    which the caller puts back (in a ``finally``) when its layers are done."""
    prev = getattr(_local, "frame", None)
    _local.frame = frame
    return prev


@contextmanager
def running_layer(
    layer: int, microbatch: int, recompute: bool, store: RecomputeStore | None, device: torch.device
) -> Iterator[None]:
    """Mark the current thread as running ``layer`` for ``microbatch`` (engine use)."""
    prev = set_frame(LayerFrame(layer, microbatch, recompute, store, device))
    try:
        yield
    finally:
        _local.frame = prev


def doing_recompute() -> bool:
    """True while a layer's forward is re-run for the backward pass."""
    f = _frame()
    return f is not None and f.recompute


def current_layer() -> int | None:
    """Index of the layer this thread is running, or None outside RoundPipe."""
    f = _frame()
    return None if f is None else f.layer


def current_microbatch() -> int | None:
    """Index of the microbatch this thread is running, or None outside RoundPipe."""
    f = _frame()
    return None if f is None else f.microbatch


def save_for_recompute(*data: Any) -> None:
    """Keep ``data`` from this layer's forward for its recompute pass.

    Tensors are kept on the host, so the recompute may run on another device.
    Outside RoundPipe, or during the recompute itself, this does nothing.
    """
    f = _frame()
    if f is None or f.recompute or f.store is None:
        return
    host = tree_map(lambda t: t.detach().to("cpu") if isinstance(t, torch.Tensor) else t, data)
    f.store.put((f.layer, f.microbatch), host)


def get_recompute_data() -> Any:
    """During recompute, what this layer passed to ``save_for_recompute`` in its forward.

    Returns:
        The tuple of what was saved, always a tuple (one saved object comes back as a
        1-tuple: ``x, = get_recompute_data()``), as the published RoundPipe. Tensors
        come back on the device the recompute runs on.
    """
    f = _frame()
    if f is None or not f.recompute:
        raise RuntimeError("get_recompute_data() is only valid while doing_recompute() is True")
    assert f.store is not None
    data = f.store.get((f.layer, f.microbatch))
    dev = f.device
    data = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, data)
    return tuple(data)


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
_NO_AUTOCAST = nullcontext()  # reusable: it keeps no state between uses


class AutocastState:
    """The calling thread's ``torch.autocast`` state per device type, captured so that a
    worker computes under the caller's autocast for *its own* device type (what plain
    PyTorch would do with the model on that device)."""

    __slots__ = ("cache_enabled", "states")

    def __init__(self, states: dict[str, torch.dtype], cache_enabled: bool = True) -> None:
        self.states = states  # device type -> dtype, only for enabled device types
        self.cache_enabled = cache_enabled

    @classmethod
    def capture(cls) -> AutocastState:
        """The current thread's autocast state."""
        states = {
            dev: torch.get_autocast_dtype(dev)
            for dev in _AUTOCAST_DEVICE_TYPES
            if torch.is_autocast_enabled(dev)
        }
        return cls(states, torch.is_autocast_cache_enabled())

    def active(self, device: torch.device) -> AbstractContextManager[Any] | None:
        """The autocast context for ``device``'s compute, or None when there is none to
        enter (the runtime then skips the ``with`` per layer)."""
        if not self.states or device.type not in self.states:
            return None
        return self.enter(device)

    def enter(self, device: torch.device) -> AbstractContextManager[Any]:
        """A context running ``device``'s compute under the captured autocast (or nothing)."""
        dtype = self.states.get(device.type)
        if dtype is None:
            return _NO_AUTOCAST  # the common case, once per layer: no new object
        return torch.autocast(device.type, dtype=dtype, cache_enabled=self.cache_enabled)
