"""The disk tier (``RoundPipe(..., offload_dir=PATH)``): the fp32 masters and the optimizer
state live in files under ``PATH``, streamed layer by layer, deepest first, through a
bounded host buffer by the layer-wise step; between steps a master is *released*
(``MasterWeights.release``) and the optimizer holds no state for it. The layout, the
write-then-publish rule of the two slot files and the IO (``O_DIRECT``) are in
docs/host-memory.md ("Beyond host RAM").

The tier is a *remote publisher* of every master (``versions.RemotePublisher``): a step's
version is published by reading each layer's masters from the current slot into the
model, so the one-step-stale step works as in RAM.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import math
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..kinds import check_int
from .layerwise import step_subset, steps_elementwise
from .masters import MasterWeights

__all__ = [
    "STEP_UNSUPPORTED",
    "DiskTier",
    "check_offload_args",
]

_ALIGN = 4096
#: parameter-sized optimizer states a record has room for before the first step (Adam's
#: two); a record that needs more is moved to the end of its slot file
_RESERVED_STATES = 2
_MASTER = "__master__"

STEP_UNSUPPORTED = (
    "with offload_dir the fp32 masters and the optimizer state live on disk and only the "
    "layer-wise step can stream them: step with "
    "rp.step_layerwise(functools.partial(step_subset, optimizer), finish=optimizer.zero_grad) "
    "(step_subset from roundpipe_core.stepping.layerwise), with an optimizer over "
    "rp.optim_parameters() for which steps_elementwise(optimizer) holds (Adam, AdamW, SGD, ...)"
)


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of ``nbytes`` (what ``O_DIRECT`` needs)."""
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % _ALIGN
    return raw[start : start + nbytes]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"the disk tier's index names an unknown dtype {name!r}")
    return dt


def _pread(fd: int, buf: torch.Tensor, offset: int) -> None:
    _whole(os.preadv, fd, buf, offset, "short read from")


def _pwrite(fd: int, buf: torch.Tensor, offset: int) -> None:
    _whole(os.pwritev, fd, buf, offset, "short write to")


def _whole(io: Callable[..., int], fd: int, buf: torch.Tensor, offset: int, what: str) -> None:
    """``io`` (``os.preadv`` / ``os.pwritev``) over all of ``buf``'s bytes at ``offset``,
    resumed after a partial transfer; none at all is an EIO."""
    view = memoryview(buf.numpy())  # type: ignore[arg-type]  # (ndarray is a buffer)
    done, n = 0, len(view)
    while done < n:
        k = io(fd, [view[done:]], offset + done)
        if k <= 0:
            raise OSError(errno.EIO, f"{what} the disk tier at offset {offset + done}")
        done += k


@dataclass
class _Layout:
    """Where one master's record lies in a slot file and what it holds: ``entries`` are
    ``(key, dtype, shape)`` of its tensors (the master first, then the state's), each
    starting on a page; ``scalars`` the state's non-tensor values."""

    offset: int
    capacity: int
    entries: list[tuple[str, str, tuple[int, ...]]]
    scalars: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(_entry_bytes(dt, shape) for _, dt, shape in self.entries)


def _entry_bytes(dtype: str, shape: Sequence[int]) -> int:
    return _pad(math.prod(shape) * _dtype(dtype).itemsize)


class _Record:
    """One master's record in host memory: a page-aligned buffer and the tensors in it."""

    def __init__(self, layout: _Layout, buf: torch.Tensor) -> None:
        self.layout = layout
        self.buf = buf
        self.tensors: dict[str, torch.Tensor] = {}
        pos = 0
        for key, dt, shape in layout.entries:
            dtype = _dtype(dt)
            n = math.prod(shape) * dtype.itemsize
            self.tensors[key] = buf[pos : pos + n].view(dtype).view(shape)
            pos += _entry_bytes(dt, shape)

    def state(self) -> dict[str, Any]:
        """The optimizer state it holds: its tensors but the master's, and its scalars."""
        return {**{k: t for k, t in self.tensors.items() if k != _MASTER}, **self.layout.scalars}


def _positions(opt: torch.optim.Optimizer) -> dict[int, int]:
    """Parameter id -> its position in the optimizer's groups (a state dict's key)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {id(p): pos for pos, p in enumerate(params)}


def _cancel(fut: Future) -> None:
    fut.cancel()
    with contextlib.suppress(BaseException):
        fut.result()


def check_offload_args(offload_dir: Any, shared_masters: bool | None, owns_masters: bool) -> bool:
    """``shared_masters`` for a RoundPipe with ``offload_dir``: False (a shared master is
    the model's weight, which must stay resident).

    Raises:
        TypeError: ``offload_dir`` is not a path.
        ValueError: ``shared_masters=True``, or a RoundPipe whose masters another owns.
    """
    if not isinstance(offload_dir, (str, os.PathLike)):
        raise TypeError(
            f"offload_dir must be a directory path (str or os.PathLike), got {type(offload_dir).__name__}"
        )
    if shared_masters:
        raise ValueError(
            "offload_dir keeps the fp32 masters on disk, so they cannot be the model's own "
            "weights: pass shared_masters=False (or leave it None) with offload_dir"
        )
    if not owns_masters:
        raise ValueError(
            "offload_dir is for the RoundPipe that owns the masters; this one's master_owner "
            "holds them: pass offload_dir to the owner"
        )
    return False


class DiskTier:
    """The store and the streamed step of one RoundPipe (see the module docstring).

    Args:
        path: the directory (``offload_dir``); the store is a fresh directory in it,
            removed when the RoundPipe closes.
        masters: the RoundPipe's masters (all separate copies); released here.
        layers: the model's layers (a master belongs to the first layer holding it).
        name: the RoundPipe's name (for its IO threads' names).
        buffer_layers: layers' records resident at most (read ahead, stepping, written
            behind); at least 1.

    Raises:
        ValueError: ``path`` is not a writable directory or lacks the space.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        masters: MasterWeights,
        layers: Sequence[nn.Module],
        name: str = "RoundPipe",
        buffer_layers: int = 3,
    ) -> None:
        check_int(buffer_layers, "buffer_layers")
        self.path = os.fspath(path)
        self.masters = masters
        self._params = [m for _, _, m in masters.copies]
        if len(self._params) != len(masters.entries):
            raise ValueError("offload_dir needs separate masters (shared_masters=False)")
        self._index = {id(m): i for i, m in enumerate(self._params)}
        self._names = [n for n, _, _ in masters.copies]
        self._model_param = [p for _, p, _ in masters.copies]
        # a master's layer: the first holding it (the backward completes deep layers first)
        self._layer: list[int] = [0] * len(self._params)
        self._layer_keys: dict[int, list[int]] = {}
        for li in reversed(range(len(layers))):  # (a shallower layer overwrites a deeper)
            for m in masters.of_layers([layers[li]]):
                self._layer[self._index[id(m)]] = li
        for i in range(len(self._params)):
            self._layer_keys.setdefault(self._layer[i], []).append(i)
        capacities = [
            _pad(m.numel() * m.element_size()) * (1 + _RESERVED_STATES) + _ALIGN
            for m in self._params
        ]
        #: the resident bound: buffer_layers of the largest layer's records (their states
        #: included: a record is at most its capacity)
        self.limit = buffer_layers * max(
            [sum(capacities[i] for i in keys) for keys in self._layer_keys.values()] or [0]
        )
        self.disk_bytes = 2 * sum(capacities)
        self._dir = self._make_store(self.disk_bytes)
        # allocate the two slots' layouts: the same place in each
        self._layouts: list[list[_Layout]] = [[], []]
        end = 0
        for m, cap in zip(self._params, capacities):
            entry = (_MASTER, str(m.dtype), tuple(m.shape))
            for s in (0, 1):
                self._layouts[s].append(_Layout(end, cap, [entry]))
            end += cap
        self._end = [end, end]
        self.direct = False
        self._fds = self._open_slots(end)
        self.gen = 0
        self._pending: list[_Layout] | None = None  # the next slot's layouts, being written
        self._stepped: set[int] = set()
        self._wanted: set[int] = set()  # the records the part being stepped needs
        self._lock = threading.Condition()
        self._resident = 0  # bytes of records alive (read ahead, stepping, being written)
        self.peak_resident = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_seconds = 0.0  # the IO threads' (and publication's) time in reads and writes
        self._reads: dict[int, tuple[Future, int]] = {}  # index -> (future _Record, bytes)
        self._writes: list[Future] = []
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-tier-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-tier-write")
        self._optimizer: torch.optim.Optimizer | None = None
        # gen 0: the masters, made from the model's parameters one at a time (a master
        # made without values, MasterWeights(values=False), never holds all of them)
        for i, m in enumerate(self._params):
            placeholder = m.untyped_storage().nbytes() < m.numel() * m.element_size()
            src = self._model_param[i] if placeholder else m
            rec = self._record_of(self._layouts[0][i], {_MASTER: src.detach().to(m.dtype)}, {})
            _pwrite(self._fds[0], rec.buf, rec.layout.offset)
        self._sync_slot(0)
        self._write_index()
        masters.release(self._params, None)
        masters.publishers.append(self)
        self._finalizer = weakref.finalize(
            self, _close_store, self._fds, self._dir, self._reader, self._writer
        )

    # -- the files -----------------------------------------------------------------------
    def _make_store(self, need: int) -> str:
        path = self.path
        if not os.path.isdir(path):
            raise ValueError(f"offload_dir {path!r} is not a directory: create it first")
        try:
            store = tempfile.mkdtemp(prefix="roundpipe-tier-", dir=path)
        except OSError as e:
            raise ValueError(
                f"offload_dir {path!r} is not writable ({e.strerror}): pass a directory "
                "this process may create files in"
            ) from e
        free = shutil.disk_usage(store).free
        if free < need:
            shutil.rmtree(store, ignore_errors=True)
            raise ValueError(
                f"offload_dir {path!r} has {free / 2**30:.2f} GiB free; the fp32 masters and "
                f"optimizer state need {need / 2**30:.2f} GiB there (two slots: a step writes "
                "the new state beside the last good one): free space or choose another "
                "directory"
            )
        return store

    def _open_slots(self, size: int, direct: bool = True) -> list[int]:
        """The two slot files, ``O_DIRECT`` where the file system takes it."""
        flags = os.O_RDWR | os.O_CREAT
        fds: list[int] = []
        try:
            for s in (0, 1):
                f = os.path.join(self._dir, f"slot{s}.bin")
                fd = -1
                if direct and hasattr(os, "O_DIRECT"):
                    with contextlib.suppress(OSError):
                        fd = os.open(f, flags | os.O_DIRECT, 0o600)
                        self.direct = True
                if fd < 0:
                    fd = os.open(f, flags, 0o600)
                    self.direct = False
                fds.append(fd)
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, max(size, _ALIGN))  # the space is ours now
        except OSError as e:
            for fd in fds:
                os.close(fd)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise ValueError(
                f"offload_dir {self.path!r}: could not create the store's files ({e}); "
                "check the directory's space and permissions"
            ) from e
        if self.direct:  # a file system may accept O_DIRECT at open and refuse the IO
            try:
                _pwrite(fds[0], _aligned_empty(_ALIGN), 0)
            except OSError:
                for fd in fds:
                    os.close(fd)
                return self._open_slots(size, False)
        return fds

    def _sync_slot(self, slot: int) -> None:
        os.fsync(self._fds[slot])
        if not self.direct and hasattr(os, "posix_fadvise"):
            # written pages are clean after fsync: drop them from the page cache
            os.posix_fadvise(self._fds[slot], 0, 0, os.POSIX_FADV_DONTNEED)

    def _write_index(self) -> None:
        """The store's index (the current generation and its records), replaced atomically."""
        slot = self.gen % 2
        doc = {
            "gen": self.gen,
            "slot": slot,
            "names": self._names,
            "records": [asdict(lay) for lay in self._layouts[slot]],
        }
        tmp = os.path.join(self._dir, "index.json.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self._dir, "index.json"))
        dfd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # -- records -------------------------------------------------------------------------
    def _record_of(
        self, layout: _Layout, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]
    ) -> _Record:
        rec = _Record(layout, _aligned_empty(layout.nbytes))
        with torch.no_grad():
            for key, t in tensors.items():
                rec.tensors[key].copy_(t)
        layout.scalars = scalars
        return rec

    def _read(self, slot: int, layout: _Layout) -> _Record:
        rec = _Record(layout, _aligned_empty(layout.nbytes))
        self._io(_pread, self._fds[slot], rec.buf, layout.offset)
        return rec

    def _io(self, io: Callable[[int, torch.Tensor, int], None], *args: Any) -> None:
        t0 = time.perf_counter()
        io(*args)
        self.io_seconds += time.perf_counter() - t0

    def _alloc(self, slot: int, i: int, tensors: dict[str, torch.Tensor]) -> _Layout:
        """Record ``i``'s layout for writing ``tensors`` into ``slot``: where it was if it
        fits there, else at the end of the slot file."""
        old = self._pending[i] if self._pending is not None else self._layouts[slot][i]
        entries = [(k, str(t.dtype), tuple(t.shape)) for k, t in tensors.items()]
        new = _Layout(old.offset, old.capacity, entries)
        if new.nbytes > old.capacity:
            new.offset, new.capacity = self._end[slot], new.nbytes
            self._end[slot] += new.nbytes
        return new

    # -- the bounded buffer --------------------------------------------------------------
    def _take_bytes(self, n: int, block: bool) -> bool:
        """Count ``n`` bytes resident, waiting for writes behind (or dropping records read
        ahead but not needed now) while over the bound; ``block=False``: only if they fit."""
        with self._lock:
            while self._resident + n > self.limit:
                if not block:
                    return False
                if any(not w.done() for w in self._writes):
                    self._lock.wait(0.05)
                    continue
                if not self._drop_read_ahead():
                    break  # nothing else resident to wait for: one record over the bound
            self._resident += n
            self.peak_resident = max(self.peak_resident, self._resident)
            return True

    def _give_bytes(self, n: int) -> None:
        with self._lock:
            self._resident -= n
            self._lock.notify_all()

    def _drop_read_ahead(self) -> bool:
        """Drop one record read ahead that no part asks for now (call with the lock held)."""
        for i, (fut, n) in list(self._reads.items()):
            if i in self._wanted:
                continue
            del self._reads[i]
            _cancel(fut)
            self._resident -= n
            return True
        return False

    def _read_ahead(self, order: Iterable[int], block: bool) -> None:
        """Submit reads of ``order``'s records from the current slot, while they fit."""
        slot = self.gen % 2
        for i in order:
            if i in self._reads:
                continue
            layout = self._layouts[slot][i]
            # the room the record has: what it may grow to in this step (its first state)
            n = max(layout.nbytes, layout.capacity)
            if not self._take_bytes(n, block):
                return
            self._reads[i] = (self._reader.submit(self._read, slot, layout), n)

    # -- the streamed step ---------------------------------------------------------------
    def streamed(self, step_params: Callable[[list[nn.Parameter]], Any]) -> Callable[..., Any]:
        """What ``step_layerwise`` runs in place of ``step_params``: the same step, paged
        in from the store and written behind.

        Raises:
            ValueError: ``step_params`` is not ``functools.partial(step_subset, optimizer)``
                of an elementwise optimizer over these masters (:data:`STEP_UNSUPPORTED`).
        """
        opt = self._optimizer_of(step_params)
        kwargs = dict(step_params.keywords) if isinstance(step_params, functools.partial) else {}
        return functools.partial(self.step, opt, kwargs=kwargs)

    def _optimizer_of(self, step_params: Any) -> torch.optim.Optimizer:
        if not (
            isinstance(step_params, functools.partial)
            and step_params.func is step_subset
            and len(step_params.args) == 1
            and isinstance(step_params.args[0], torch.optim.Optimizer)
        ):
            raise ValueError(STEP_UNSUPPORTED)
        opt: torch.optim.Optimizer = step_params.args[0]
        if not steps_elementwise(opt):
            raise ValueError(
                f"{type(opt).__name__} does not step each parameter from its own gradient "
                f"and state alone (steps_elementwise is False). {STEP_UNSUPPORTED}"
            )
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in self._index:
                    raise ValueError(
                        "the optimizer holds a tensor that is not one of this RoundPipe's "
                        f"masters (shape {tuple(p.shape)}). {STEP_UNSUPPORTED}"
                    )
        # the same optimizer, or a copy of it sharing its state (Lightning's queued step
        # runs on such a twin, with the hyperparameters of the moment it was queued)
        if self._optimizer is not None and self._optimizer.state is not opt.state:
            raise ValueError(
                "offload_dir stores one optimizer's state: step with the same optimizer "
                "every time (its state for these masters is on disk)"
            )
        if self._optimizer is None:
            self._optimizer = opt
        return opt

    def step(self, opt: torch.optim.Optimizer, part: Sequence[nn.Parameter], kwargs: dict) -> None:
        """Step ``part`` (masters) from the store; once every master has been stepped,
        publish the new generation. An error leaves the last good generation current."""
        try:
            self._step(opt, part, kwargs)
        except BaseException:
            self._abort(opt)
            raise

    def _step(self, opt: torch.optim.Optimizer, part: Sequence[nn.Parameter], kw: dict) -> None:
        idx = [self._index[id(m)] for m in part]
        if any(i in self._stepped for i in idx):
            raise RuntimeError("the disk tier was asked to step a master twice in one step")
        if self._pending is None:
            nxt = (self.gen + 1) % 2
            self._pending = list(self._layouts[nxt])
        # deepest layer first, one layer's part at a time
        order = sorted(idx, key=lambda i: -self._layer[i])
        pieces = [list(g) for _, g in itertools.groupby(order, key=lambda i: self._layer[i])]
        self._wanted = set(order)
        self._read_ahead(order, block=False)
        pos = 0
        for piece in pieces:
            pos += len(piece)
            self._read_ahead(piece, block=True)  # those that did not fit before
            records = {i: self._take_read(i) for i in piece}
            self._read_ahead(order[pos:], block=False)  # the next layers, while this steps
            for i, (rec, _) in records.items():  # the part's masters and state, resident
                self._params[i].data = rec.tensors[_MASTER]
                opt.state[self._params[i]] = rec.state()
            step_subset(opt, [self._params[i] for i in piece], **kw)
            self._write_behind(opt, records)
            self._stepped.update(piece)
        self._wanted = set()
        if len(self._stepped) == len(self._params):
            self._commit()
        else:  # the layers the backward completes next
            left = sorted(
                (i for i in range(len(self._params)) if i not in self._stepped),
                key=lambda i: -self._layer[i],
            )
            self._read_ahead(left, block=False)

    def _take_read(self, i: int) -> tuple[_Record, int]:
        fut, n = self._reads.pop(i)
        try:
            rec = fut.result()
        except BaseException:
            self._give_bytes(n)
            raise
        self.bytes_read += n
        return rec, n

    def _write_behind(
        self, opt: torch.optim.Optimizer, records: dict[int, tuple[_Record, int]]
    ) -> None:
        nxt = (self.gen + 1) % 2
        assert self._pending is not None
        for i in list(records):
            rec, n = records.pop(i)  # (the caller's dict lets go of the read buffer too)
            m = self._params[i]
            state = opt.state.pop(m, {})
            tensors: dict[str, torch.Tensor] = {_MASTER: m.detach()}
            scalars: dict[str, Any] = {}
            for k, v in sorted(state.items()):
                if isinstance(v, torch.Tensor):
                    if v.device.type != "cpu":
                        raise TypeError(
                            f"offload_dir stores CPU optimizer state; {type(opt).__name__}'s "
                            f"state {k!r} of {self._names[i]!r} is on {v.device}"
                        )
                    tensors[str(k)] = v.detach()
                elif v is None or isinstance(v, (bool, int, float, str)):
                    scalars[str(k)] = v
                else:
                    raise TypeError(
                        f"offload_dir stores tensors and plain numbers of an optimizer's "
                        f"state; {type(opt).__name__}'s state {k!r} is a {type(v).__name__}"
                    )
            m.data = torch.zeros((), dtype=m.dtype).expand(m.shape)
            with self.masters.grad_lock:
                m.grad = None  # consumed: resident gradients are the ones not stepped yet
            layout = self._alloc(nxt, i, tensors)
            same = layout.entries == rec.layout.entries and all(
                rec.tensors[k].data_ptr() == t.data_ptr() for k, t in tensors.items()
            )
            if same:  # stepped in place in the read buffer: write it as it is
                layout.scalars = scalars
                out = rec
            else:  # new state tensors (a first step): gather them into one buffer
                if layout.nbytes > n:  # (the read reserved the record's room)
                    self._take_bytes(layout.nbytes - n, block=True)
                    n = layout.nbytes
                out = self._record_of(layout, tensors, scalars)
            del tensors, rec
            self._pending[i] = layout
            fut = self._writer.submit(self._io, _pwrite, self._fds[nxt], out.buf, layout.offset)
            self.bytes_written += layout.nbytes
            fut.add_done_callback(lambda _, n=n: self._give_bytes(n))  # type: ignore[misc]
            self._writes.append(fut)

    def _commit(self) -> None:
        """Every master stepped: wait for the writes, fsync, then publish the generation."""
        writes, self._writes = self._writes, []
        for w in writes:
            w.result()  # an IO error is raised here, before anything is published
        nxt = (self.gen + 1) % 2
        self._sync_slot(nxt)
        assert self._pending is not None
        self._layouts[nxt] = self._pending
        self._pending = None
        self.gen += 1
        self._write_index()
        self._stepped = set()

    def _abort(self, opt: torch.optim.Optimizer | None) -> None:
        """After a failed step: drop what is resident and the half-written slot (its
        layouts are forgotten); the current generation is untouched."""
        for fut, n in self._reads.values():
            _cancel(fut)
            self._give_bytes(n)
        self._reads = {}
        for w in self._writes:
            with contextlib.suppress(BaseException):
                w.result()
        self._writes = []
        for m in self._params:
            m.data = torch.zeros((), dtype=m.dtype).expand(m.shape)
            if opt is not None:
                opt.state.pop(m, None)
        nxt = (self.gen + 1) % 2
        self._end[nxt] = max(lay.offset + lay.capacity for lay in self._layouts[nxt])
        self._pending = None
        self._stepped = set()
        self._wanted = set()

    # -- publication into the model (versions.RemotePublisher) ---------------------------
    @property
    def keys(self) -> list[int]:
        return [id(m) for m in self._params]

    def publish(
        self,
        version: int,
        claim: Callable[[Sequence[int]], None],
        mark: Callable[[Sequence[int]], None],
    ) -> None:
        """Write the current generation's masters into the model, layer by layer (shallow
        first), once the readers of the older weights are done with each."""
        del version  # the store holds exactly the last completed step
        for li in sorted(self._layer_keys):
            keys = self._layer_keys[li]
            ids = [id(self._params[i]) for i in keys]
            claim(ids)
            for i in keys:
                with torch.no_grad():
                    self._model_param[i].copy_(self.master_values(i))
            mark(ids)

    def master_values(self, i: int) -> torch.Tensor:
        """Master ``i``'s values in the current generation (read now, a fresh tensor)."""
        slot = self.gen % 2
        lay = self._layouts[slot][i]
        head = _Layout(lay.offset, lay.capacity, lay.entries[:1])  # the master's entry only
        rec = self._read(slot, head)
        self.bytes_read += head.nbytes
        return rec.tensors[_MASTER]

    # -- checkpoints ---------------------------------------------------------------------
    def _records_mapped(self) -> list[_Record]:
        """The current slot's records, memory-mapped (saving reads them from the page cache)."""
        slot = self.gen % 2
        f = os.path.join(self._dir, f"slot{slot}.bin")
        size = os.fstat(self._fds[slot]).st_size
        mapped = torch.from_file(f, shared=True, size=size, dtype=torch.uint8)
        return [
            _Record(lay, mapped[lay.offset : lay.offset + lay.nbytes])
            for lay in self._layouts[slot]
        ]

    def masters_state(self) -> dict[str, torch.Tensor]:
        """``{parameter name: master}`` of the current generation, as in RAM (tensors that
        map the store's file: valid until the second step from now; copy to keep)."""
        self._check_idle()
        return {
            self._names[i]: rec.tensors[_MASTER] for i, rec in enumerate(self._records_mapped())
        }

    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """``opt.state_dict()`` as the same run in RAM would give it (state indexed by the
        parameters' positions in the groups), its tensors mapping the store's file
        (see :meth:`masters_state`)."""
        self._check_idle()
        recs = self._records_mapped()
        sd = opt.state_dict()
        sd["state"] = {}
        for pid, pos in _positions(opt).items():
            i = self._index.get(pid)
            if i is not None and (entry := recs[i].state()):
                sd["state"][pos] = entry
        return sd

    def load_state(
        self,
        masters: dict[str, torch.Tensor] | None,
        opt: torch.optim.Optimizer | None = None,
        optimizer_state: dict[str, Any] | None = None,
    ) -> None:
        """Put a checkpoint's masters (``{name: tensor}``; a name missing: its model
        parameter's values; ``None``: keep the current ones) and ``optimizer_state`` (an
        ordinary ``opt.state_dict()``) into the store as a new generation, and the masters
        into the model's parameters; ``opt`` gets the param groups (lr, ...)."""
        self._check_idle()
        by_pos: dict[int, dict[str, Any]] = {}
        if optimizer_state is not None:
            if opt is None:
                raise ValueError("load_state needs the optimizer to load an optimizer state into")
            groups_only = {"state": {}, "param_groups": optimizer_state["param_groups"]}
            opt.load_state_dict(groups_only)  # (checks the groups match)
            by_pos = {int(k): v for k, v in optimizer_state["state"].items()}
            self._optimizer_of(functools.partial(step_subset, opt))
        pos_of = _positions(opt) if opt is not None else {}
        nxt = (self.gen + 1) % 2
        self._pending = list(self._layouts[nxt])
        try:
            for i, m in enumerate(self._params):
                if masters is None:  # keep the current masters
                    src = self.master_values(i)
                else:  # (one the checkpoint lacks: its model parameter's values, as in RAM)
                    src = masters.get(self._names[i], self._model_param[i].detach())
                if tuple(src.shape) != tuple(m.shape):
                    raise ValueError(
                        f"checkpoint master {self._names[i]!r} has shape {tuple(src.shape)}, "
                        f"the parameter {tuple(m.shape)}"
                    )
                tensors: dict[str, torch.Tensor] = {_MASTER: src.detach().to(m.dtype)}
                scalars: dict[str, Any] = {}
                for k, v in sorted(by_pos.get(pos_of.get(id(m), -1), {}).items()):
                    if isinstance(v, torch.Tensor):
                        tensors[str(k)] = v.detach().cpu()
                    else:
                        scalars[str(k)] = v
                layout = self._alloc(nxt, i, tensors)
                rec = self._record_of(layout, tensors, scalars)
                _pwrite(self._fds[nxt], rec.buf, layout.offset)
                self._pending[i] = layout
                with torch.no_grad():
                    self._model_param[i].copy_(tensors[_MASTER])
            self._commit()
        except BaseException:
            self._abort(None)
            raise

    def _check_idle(self) -> None:
        if self._pending is not None or self._stepped:
            raise RuntimeError(
                "the disk tier is in the middle of a step: synchronize() the RoundPipe before "
                "reading or loading its masters and optimizer state"
            )

    def close(self) -> None:
        """Remove the store (its files) and stop the IO threads."""
        if self in self.masters.publishers:
            self.masters.publishers.remove(self)
        self._finalizer()


def _close_store(
    fds: list[int], store: str, reader: ThreadPoolExecutor, writer: ThreadPoolExecutor
) -> None:
    reader.shutdown(wait=True)
    writer.shutdown(wait=True)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    shutil.rmtree(store, ignore_errors=True)
