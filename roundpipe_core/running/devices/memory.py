"""Host memory the devices read (the model's pinned weights) and the CUDA allocator's
settings.

``pin_model`` decides how the CPU copy of the weights is made page-locked, which lets
uploads run asynchronously at full PCIe bandwidth:

- ``"alloc"``: the weights are copied into pinned memory, packed into a few large slabs,
  so PyTorch's pinned allocator (which rounds every request up to a power of two)
  wastes at most the tail of each slab instead of up to half of every tensor.
- ``"register"``: the storages are page-locked in place (``cudaHostRegister``; no second
  copy, uploads a little slower).
- ``"off"``: nothing is pinned (e.g. weights ``mmap``-ed from disk); uploads go through
  the driver's staging buffers.

Without CUDA every mode is accepted and does nothing.

``ReusedHostTensors`` hands out pageable host memory for results written every step
(downloaded and converted gradients) again once nobody holds it.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...kinds import PinMode, parse_kind

__all__ = [
    "DEFAULT_SLAB_BYTES",
    "PinHandle",
    "ReusedHostTensors",
    "cuda_available",
    "default_allocator_settings",
    "pack_module_tensors",
    "pack_slabs",
    "page_ranges",
    "page_size",
    "pin_model",
    "registered_ranges",
    "slab_sizes",
]

#: Size of one pinned slab for ``pin_model="alloc"``: a power of two, so the
#: pinned allocator does not round it up. Storages larger than a slab get a
#: slab of their own.
DEFAULT_SLAB_BYTES = 256 * 1024**2

#: Alignment of each storage inside a slab (bytes); 512 keeps every tensor
#: aligned for vectorised kernels and DMA.
_ALIGN = 512

#: cudaErrorHostMemoryAlreadyRegistered: the pages were already pinned.
_CUDA_ERR_ALREADY_REGISTERED = 712


def cuda_available() -> bool:
    """Whether a usable CUDA device exists; never raises."""
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001 - a broken driver means "no GPU" here
        return False


def default_allocator_settings() -> bool:
    """Ask for expandable segments before CUDA starts unless the user configured the
    allocator (whether it was set now): a worker allocates on four streams and the
    caching allocator reuses a block only on the stream that freed it, so stages of
    different sizes fragment; expandable segments grow and shrink in place."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return False
    try:
        if torch.cuda.is_initialized():
            return False
    except Exception:  # noqa: BLE001 - a broken driver: CUDA will not start either
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


def allocator_reserve_bytes() -> int:
    """Bytes one worker's caching allocator may reserve above what it allocates: on each of
    its 4 streams (parameter and activation uploads, compute, downloads) a 2 MiB
    small-pool segment, plus one 2 MiB page with expandable segments (the default), else
    a 20 MiB segment for a request under 10 MiB."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    return 4 * (2 + (2 if expandable else 20)) * 1024**2


class ReusedHostTensors:
    """Host tensors whose memory is handed out again once nothing else holds it.

    Why: the first write to fresh pageable memory faults it in page by page. On an H200
    host a download into a fresh tensor ran at 1.0-1.2 GB/s, into memory written before
    at 11-13 GB/s (docs/benchmarks.md, "First run on a GPU"), and a gradient has the same
    shape every step. A storage is reused only while this holds its sole reference, so a
    tensor anyone kept (a ``.grad`` not zeroed yet, a view of it) is never overwritten.
    Keeps at most as many storages of each size as were in use at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[int, list[torch.UntypedStorage]] = {}

    def take(
        self, shape: torch.Size, dtype: torch.dtype, new: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """An uninitialised contiguous tensor: reused memory, else ``new()`` (kept for later)."""
        nbytes = shape.numel() * dtype.itemsize
        if nbytes == 0 or _use_count is None:
            return new()
        with self._lock:
            kept = self._kept.setdefault(nbytes, [])
            for storage in kept:
                if _use_count(storage._cdata) == 1:  # only this list holds it
                    return torch.empty(0, dtype=dtype).set_(storage).view(shape)
            out = new()
            kept.append(out.untyped_storage())
            return out


# how many tensors and storage handles share a storage (private, present since torch 1.13;
# without it nothing is reused)
_use_count = getattr(torch._C, "_storage_Use_Count", None)


@dataclass
class PinHandle:
    """What ``pin_model`` did (``mode`` requested; ``active`` False for a no-op; ``nbytes``
    made page-locked; "register": the ``(pointer, nbytes)`` ranges ``registered``), and
    how to undo it."""

    mode: str
    active: bool = False
    nbytes: int = 0
    registered: list[tuple[int, int]] = field(default_factory=list)

    def release(self) -> None:
        """Unregister what "register" pinned, before the storages are freed (idempotent;
        ``RuntimeError`` after trying all if ``cudaHostUnregister`` refused a range)."""
        if not self.registered:
            return
        cudart = torch.cuda.cudart()
        failed: list[tuple[int, int, int]] = []
        with _REGISTRY_LOCK:
            for ptr, size in self.registered:
                code = _error_code(cudart.cudaHostUnregister(ptr))
                _REGISTERED.pop(ptr, None)
                if code != 0:
                    _clear_last_cuda_error(cudart)
                    failed.append((ptr, size, code))
            self.registered = []
            self.active = False
        if failed:
            ptr, size, code = failed[0]
            raise RuntimeError(
                f"cudaHostUnregister failed for {len(failed)} range(s), the first of {size} "
                f"bytes at {ptr:#x} with CUDA error {code}; that host memory stays page-locked "
                "until the process exits (pin_model='alloc' avoids registering)"
            )


def _storage_groups(
    tensors: Iterable[torch.Tensor],
) -> list[tuple[torch.UntypedStorage, list[torch.Tensor]]]:
    """Group CPU tensors by the storage they view, so shared storages are handled once."""
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        groups.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    return list(groups.values())


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def next_pow2(n: int) -> int:
    """The pinned allocator's block for ``n`` bytes: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def pack_slabs(sizes: Sequence[int], slab_bytes: int = DEFAULT_SLAB_BYTES) -> list[tuple[int, int]]:
    """Assign each storage (by byte size) a ``(slab index, byte offset)``, first-fit in
    order, offsets aligned to 512 bytes. A slab holds ``slab_bytes``; a larger storage
    opens a slab of the next power of two, whose leftover room later ones fill."""
    if slab_bytes <= 0:
        raise ValueError(f"slab_bytes must be positive, got {slab_bytes}")
    placement: list[tuple[int, int]] = []
    used: list[int] = []
    capacity: list[int] = []
    for size in sizes:
        for slab in range(len(used)):
            offset = _round_up(used[slab], _ALIGN)
            if offset + size <= capacity[slab]:
                break
        else:
            slab, offset = len(used), 0
            used.append(0)
            capacity.append(slab_bytes if size <= slab_bytes else next_pow2(size))
        placement.append((slab, offset))
        used[slab] = offset + size
    return placement


def slab_sizes(sizes: Sequence[int], placement: Sequence[tuple[int, int]]) -> list[int]:
    """Bytes each slab of a ``pack_slabs`` placement must hold."""
    out: dict[int, int] = {}
    for size, (slab, offset) in zip(sizes, placement):
        out[slab] = max(out.get(slab, 0), offset + size)
    return [out[i] for i in range(len(out))]


def _rebind(t: torch.Tensor, storage: torch.UntypedStorage, byte_offset: int) -> None:
    """Point ``t`` at ``storage``, whose ``byte_offset`` is where its old storage starts."""
    elem = t.element_size()
    if byte_offset % elem:
        raise ValueError(f"misaligned slab offset {byte_offset} for element size {elem}")
    new = torch.empty(0, dtype=t.dtype, device=storage.device)
    new.set_(storage, byte_offset // elem + t.storage_offset(), t.size(), t.stride())
    # ``.data`` keeps the Parameter object (optimizer / module references stay valid).
    t.data = new


def pack_module_tensors(
    tensors: Sequence[torch.Tensor], pin: bool, slab_bytes: int = DEFAULT_SLAB_BYTES
) -> tuple[int, int]:
    """Copy the storages of ``tensors`` into packed slabs (pinned with ``pin``) and rebind
    the tensors to them, shared storages staying shared; returns ``(bytes, slabs)``."""
    groups = _storage_groups(tensors)
    sizes = [storage.nbytes() for storage, _ in groups]
    placement = pack_slabs(sizes, slab_bytes)
    slabs = [
        torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in slab_sizes(sizes, placement)
    ]
    for (storage, views), (slab, offset), size in zip(groups, placement, sizes):
        dst = slabs[slab][offset : offset + size]
        dst.copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,)))
        for t in views:
            _rebind(t, slabs[slab].untyped_storage(), offset)
    return sum(sizes), len(slabs)


def page_size() -> int:
    """The host's memory page size (4 KiB on most x86 hosts, 64 KiB on some ARM servers;
    4 KiB where it cannot be read)."""
    try:
        size = int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):  # not a POSIX host
        size = 0
    return size if size > 0 else 4096


def page_ranges(spans: Iterable[tuple[int, int]], page: int | None = None) -> list[tuple[int, int]]:
    """Merge ``(pointer, nbytes)`` spans (empty ones ignored) into disjoint ranges aligned
    to ``page`` (default this host's): ``cudaHostRegister`` refuses a range that overlaps
    one already registered, and small tensors share pages."""
    page = page_size() if page is None else page
    if page <= 0:
        raise ValueError(f"page must be a positive number of bytes, got {page}")
    merged: list[list[int]] = []
    for ptr, n in sorted(spans):
        if n <= 0:
            continue
        start, end = ptr // page * page, _round_up(ptr + n, page)
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b - a) for a, b in merged]


# Ranges this process registered through pin_model, start -> bytes: a second
# RoundPipe over (partly) the same storages registers only what is not yet
# covered, instead of provoking "already registered" errors.
_REGISTERED: dict[int, int] = {}
_REGISTRY_LOCK = threading.RLock()


def registered_ranges() -> list[tuple[int, int]]:
    """``(pointer, nbytes)`` of every host range ``pin_model(mode="register")`` holds now."""
    with _REGISTRY_LOCK:
        return sorted(_REGISTERED.items())


def _uncovered(start: int, size: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[start, start + size)`` outside the sorted disjoint ranges ``taken``."""
    end = start + size
    out: list[tuple[int, int]] = []
    # the last range starting at or before `start` may still cover it
    i = max(bisect.bisect_right(taken, (start, float("inf"))) - 1, 0)
    cursor = start
    for a, n in taken[i:]:
        b = a + n
        if a >= end:
            break
        if b <= cursor:
            continue
        if a > cursor:
            out.append((cursor, a - cursor))
        cursor = max(cursor, b)
    if cursor < end:
        out.append((cursor, end - cursor))
    return out


def _error_code(err: Any) -> int:
    """The integer of a cudart binding's return value (an enum or an int)."""
    return int(err.value) if hasattr(err, "value") else int(err)


def _clear_last_cuda_error(cudart: Any) -> None:
    """Reset this thread's CUDA "last error" after a handled one (where it can be):
    PyTorch's check after every kernel launch reads it, so a handled ``cudaHostRegister``
    error would surface as a later kernel's failure. PyTorch's binding has no
    ``cudaGetLastError``: it is looked up in the CUDA runtime the process loaded."""
    fn = getattr(cudart, "cudaGetLastError", None)
    if fn is not None:
        fn()
        return
    # the process's global symbols, then this build's sonames (dlopen returns the loaded copy)
    major = (torch.version.cuda or "").split(".")[0]
    for lib in [None, *([f"libcudart.so.{major}"] if major else []), "libcudart.so"]:
        try:
            get_last = ctypes.CDLL(lib).cudaGetLastError
        except (OSError, AttributeError):
            continue
        get_last.restype = ctypes.c_int
        get_last()
        return


def _register(groups: list[tuple[torch.UntypedStorage, list[torch.Tensor]]]) -> PinHandle:
    handle = PinHandle(mode="register", active=True)
    cudart = torch.cuda.cudart()
    with _REGISTRY_LOCK:
        taken = sorted(_REGISTERED.items())
        for ptr, size in page_ranges((s.data_ptr(), s.nbytes()) for s, _ in groups):
            for start, n in _uncovered(ptr, size, taken):
                # cudaHostRegisterDefault = 0: page-lock and map for DMA.
                code = _error_code(cudart.cudaHostRegister(start, n, 0))
                if code == _CUDA_ERR_ALREADY_REGISTERED:
                    # pinned by someone else in this process (uploads from it are still async)
                    _clear_last_cuda_error(cudart)
                    continue
                if code != 0:
                    _clear_last_cuda_error(cudart)
                    handle.release()
                    raise RuntimeError(
                        f"cudaHostRegister failed with CUDA error {code} on {n} bytes; use "
                        "pin_model='alloc' or 'off' instead (e.g. memory locked by ulimit -l)"
                    )
                handle.registered.append((start, n))
                handle.nbytes += n
                _REGISTERED[start] = n
    return handle


def pin_model(
    module: nn.Module,
    mode: str = "alloc",
    *,
    enabled: bool | None = None,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> PinHandle:
    """Make the CPU copy of ``module``'s parameters and buffers page-locked (``mode``: see
    the module docstring; ``ValueError`` for another). ``enabled``: whether the pool
    uploads to CUDA (``None``: whether CUDA is available). ``release()`` the
    :class:`PinHandle` before dropping a "register"-ed model (``RuntimeError`` if
    ``cudaHostRegister`` refuses the memory)."""
    mode = parse_kind(PinMode, mode, "pin_model")
    if enabled is None:
        enabled = cuda_available()
    if not enabled or mode == "off":
        return PinHandle(mode=mode)
    tensors = [*module.parameters(), *module.buffers()]  # (each storage handled once)
    groups = _storage_groups(list({id(t): t for t in tensors}.values()))
    # Storages already pinned (a second RoundPipe on the same model, user-pinned) stay as they are.
    groups = [(s, ts) for s, ts in groups if not ts[0].is_pinned()]
    if not groups:
        return PinHandle(mode=mode)
    if mode == "register":
        return _register(groups)
    tensors = [t for _, ts in groups for t in ts]
    nbytes, _ = pack_module_tensors(tensors, pin=True, slab_bytes=slab_bytes)
    return PinHandle(mode=mode, active=True, nbytes=nbytes)
