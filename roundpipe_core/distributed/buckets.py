"""The buckets a gradient reduction sends and the ring of flat host buffers they travel
in (:class:`BufferRing`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "REDUCE_IN_FLIGHT", "BufferRing", "reduce_buffer_bytes"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce (as DDP's ``bucket_cap_mb=25``)."""

REDUCE_IN_FLIGHT = 2
"""Buckets a reduction has in flight at once; landing the oldest frees its ring slot
for the bucket ``REDUCE_IN_FLIGHT + 1`` places later."""


def _unique_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    out: dict[int, torch.Tensor] = {}  # (in the order first seen)
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must be tensors (parameters), got {type(p).__name__}")
        out.setdefault(id(p), p)
    return list(out.values())


def _bucketize(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``params`` of one dtype, each up to ``bucket_bytes``."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets and buckets[-1][0].dtype == p.dtype and size + nbytes <= bucket_bytes:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


def copy_from_flat(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (cast where dtypes differ)."""
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off : off + n].view_as(t))
            off += n


class _Bucket:
    """Masters reduced together, laid out in a flat buffer as every gradient, then one
    "has a gradient" count per master (so a master without a gradient on every rank
    keeps ``grad=None``, as it would in one process)."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self.index = index
        self.params = params
        self.dtype = params[0].dtype
        self.numel = sum(p.numel() for p in params)
        self.flat_numel = self.numel + len(params)  # the gradients, one count per master

    def flatten(self, buf: torch.Tensor) -> torch.Tensor:
        """Copy the gradients and the counts into ``buf`` (``flat_numel`` elements)."""
        off = 0
        for p in self.params:
            n = p.numel()
            g = p.grad
            if g is None:
                buf[off : off + n].zero_()
            else:
                if g.is_sparse:
                    raise TypeError("sparse gradients cannot be all-reduced by GradientAllReducer")
                buf[off : off + n].copy_(g.reshape(-1))
            off += n
        buf[self.numel :] = torch.tensor(
            [p.grad is not None for p in self.params], dtype=self.dtype
        )
        return buf

    def unflatten(self, buf: torch.Tensor, divisor: int) -> None:
        """Copy the reduced ``buf`` into the masters' ``.grad`` (never a view: later
        buckets reuse the slot)."""
        if divisor != 1:
            buf[: self.numel].div_(divisor)
        off = 0
        had_grad = (buf[self.numel :] > 0).tolist()  # per param: some rank had a gradient
        with torch.no_grad():
            for i, p in enumerate(self.params):
                n = p.numel()
                if had_grad[i]:
                    part = buf[off : off + n].view_as(p)
                    if p.grad is None:
                        p.grad = part.clone()
                    else:
                        p.grad.copy_(part)
                off += n


class BufferRing:
    """The flat host buffers ``buckets`` travel in: per dtype ``REDUCE_IN_FLIGHT + 1``
    slots, the j-th bucket of a dtype in slot ``j mod (REDUCE_IN_FLIGHT + 1)``, each as
    large as the largest bucket it takes. Made at a dtype's first use and kept: made and
    freed every step they would stay in glibc's heaps and creep past the budget."""

    def __init__(self, buckets: Sequence[_Bucket]) -> None:
        slots, self._sizes = _slots((b.dtype, b.flat_numel) for b in buckets)
        self._slot = {b.index: k for b, k in zip(buckets, slots)}  # bucket index -> slot
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}

    def slot(self, bucket: _Bucket) -> torch.Tensor:
        """A view of ``bucket``'s slot, ``flat_numel`` elements."""
        slots = self._buffers.get(bucket.dtype)
        if slots is None:
            slots = self._buffers[bucket.dtype] = [
                torch.empty(n, dtype=bucket.dtype) for n in self._sizes[bucket.dtype]
            ]
        return slots[self._slot[bucket.index]][: bucket.flat_numel]

    def buffers(self) -> list[torch.Tensor]:
        """The buffers made so far."""
        return [t for slots in self._buffers.values() for t in slots]

    @staticmethod
    def nbytes(buckets: Iterable[list[torch.Tensor]]) -> int:
        """The bytes a ring of ``buckets`` (lists of tensors, in reduction order) holds."""
        _, sizes = _slots((b[0].dtype, sum(t.numel() for t in b) + len(b)) for b in buckets)
        return sum(sum(ns) * torch.empty((), dtype=d).element_size() for d, ns in sizes.items())


def _slots(
    buckets: Iterable[tuple[torch.dtype, int]],
) -> tuple[list[int], dict[torch.dtype, list[int]]]:
    """Each bucket's ring slot (the j-th of a dtype: ``j mod (REDUCE_IN_FLIGHT + 1)``) and,
    per dtype, each slot's elements: the largest bucket that takes it."""
    slots: list[int] = []
    sizes: dict[torch.dtype, list[int]] = {}
    seen: dict[torch.dtype, int] = {}
    for dtype, numel in buckets:
        seen[dtype] = seen.get(dtype, -1) + 1
        k = seen[dtype] % (REDUCE_IN_FLIGHT + 1)
        row = sizes.setdefault(dtype, [])
        if k == len(row):  # the first REDUCE_IN_FLIGHT + 1 buckets of the dtype
            row.append(0)
        row[k] = max(row[k], numel)
        slots.append(k)
    return slots, sizes


def reduce_buffer_bytes(
    params: Iterable[torch.Tensor], world_size: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> int:
    """Host bytes an unsharded :class:`~.reducer.GradientAllReducer` of ``params`` keeps
    over ``world_size`` ranks (its :class:`BufferRing`; 0 for one rank)."""
    if world_size == 1:
        return 0
    return BufferRing.nbytes(_bucketize(list(reversed(_unique_params(params))), bucket_bytes))
