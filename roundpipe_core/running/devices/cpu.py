"""CPU backend: a thread that plays a device on host memory (uploads lend the host
parameters, outputs are handed back without a copy, a ledger keeps the bytes a device
would hold), and the process-wide :class:`ComputeGate` under which model code runs,
since every CPU worker shares the one CPU generator. See docs/architecture.md, "Two
backends", for when stages compute side by side (``ROUNDPIPE_CPU_CONCURRENT``,
:func:`cpu_sharing_from_env`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..host_memory import available_host_memory
from .base import NBYTES, Worker

__all__ = [
    "CONCURRENT_ENV",
    "CPUWorker",
    "ComputeGate",
    "DEFAULT_CPU_DEVICE_MEMORY_GB",
    "UnexpectedDrawError",
    "cpu_sharing_from_env",
    "cpu_device_memory_bytes",
]

_CPU_GENERATOR = torch.default_generator

#: Whether CPU workers compute stages that draw no random numbers side by side (above).
CONCURRENT_ENV = "ROUNDPIPE_CPU_CONCURRENT"

#: :func:`cpu_sharing_from_env`'s answers.
SHARE_WAITED, SHARE_ALWAYS, SHARE_NEVER = "waited", "always", "never"


def cpu_sharing_from_env() -> str:
    """``ROUNDPIPE_CPU_CONCURRENT``: unset (or empty) :data:`SHARE_WAITED`, ``1``
    :data:`SHARE_ALWAYS`, ``0`` :data:`SHARE_NEVER`; ``ValueError`` for any other value."""
    raw = os.environ.get(CONCURRENT_ENV, "").strip()
    mode = {"": SHARE_WAITED, "1": SHARE_ALWAYS, "0": SHARE_NEVER}.get(raw)
    if mode is None:
        raise ValueError(
            f"environment variable {CONCURRENT_ENV}={raw!r} must be 1 (CPU workers compute "
            "stages that draw no random numbers at the same time, in every call), 0 (one "
            "stage at a time) or unset (the replicas of a one-stage plan side by side in "
            "the calls the caller waits for, the default)"
        )
    return mode


#: Memory a CPU worker reports to the planner (the default model_memory_limit
#: is 60% of it). Override with env ROUNDPIPE_CPU_DEVICE_MEMORY_GB.
DEFAULT_CPU_DEVICE_MEMORY_GB = 8.0
_MEMORY_ENV = "ROUNDPIPE_CPU_DEVICE_MEMORY_GB"


def cpu_device_memory_bytes(share: int = 1) -> int:
    """Bytes a CPU worker offers: env ``ROUNDPIPE_CPU_DEVICE_MEMORY_GB`` (GiB; ``ValueError``
    unless a positive, finite number) if set, else 8 GiB or, when less, this worker's
    ``1/share`` of the host memory available now (its stage copies come out of the host
    memory the model state may already have filled)."""
    raw = os.environ.get(_MEMORY_ENV, "").strip()
    if not raw:
        default = int(DEFAULT_CPU_DEVICE_MEMORY_GB * 1024**3)
        available = available_host_memory()
        if available is None:
            return default
        return max(1, min(default, available // max(1, share)))
    try:
        gb = float(raw)
    except ValueError:
        gb = math.nan
    # Below one byte the planner could place nothing, so it counts as zero too.
    if not math.isfinite(gb) or gb * 1024**3 < 1:
        raise ValueError(
            f"environment variable {_MEMORY_ENV}={raw!r} must be a positive number of GiB "
            f"(e.g. {_MEMORY_ENV}=8); unset it for the default of {DEFAULT_CPU_DEVICE_MEMORY_GB:g}"
        )
    return int(gb * 1024**3)


def _clones(
    tensors: Sequence[torch.Tensor], read_only: Sequence[bool] | None = None
) -> list[torch.Tensor]:
    """Detached copies made with autograd off (where a clone requires no grad: cheaper
    than a ``detach()`` per tensor), or detached aliases of the ``read_only`` ones (same
    storage, a tensor object of their own)."""
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        if read_only is None:
            return [t.clone() for t in tensors]
        return [t.detach() if ro else t.clone() for t, ro in zip(tensors, read_only)]
    finally:
        torch._C._set_grad_enabled(enabled)


class UnexpectedDrawError(RuntimeError):
    """A stage seen not to draw random numbers drew from the CPU generator beside other
    stages: from no seeded stream, which its recompute could not replay. The stage runs
    alone from then on; the next call is exact."""


#: Microbatches of a stage run alone without a draw before it may compute beside others.
CLEAN_RUNS_BEFORE_SHARING = 2
_DRAWS = -1  # the table's mark for a stage that draws

# What a CPU worker's generator does in the scope it computes in (``CPUWorker.rng_mode``).
RNG_ALONE = 0  # alone: streams are seeded and replayed as always
RNG_WATCH = 1  # alone, and every draw is noted (the stage's draws are not known yet)
RNG_SHARED = 2  # beside other stages: nothing may draw, nothing is seeded


class ComputeGate:
    """Who computes on the CPU backend now, process-wide: an exclusive holder alone (a
    stage that draws, or whose draws are not known yet), shared holders beside each
    other. Re-entrant per thread (a nested entry keeps the outer mode); a waiting
    exclusive request goes first, so shared ones do not starve it. It keeps what was
    learned per stage, keyed weakly by its first host layer, then by (job kind, first
    layer, end, train mode): the runs alone without a draw, or that the stage draws (-1)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._local = threading.local()
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._seen_lock = threading.Lock()

    def enter(self, exclusive: bool) -> tuple[bool, bool]:
        """Wait for a turn; ``(exclusive, nested)``: the mode held (a nested entry keeps
        the outer one's) and whether this thread held the gate already."""
        loc = self._local
        depth = getattr(loc, "depth", 0)
        if depth:
            loc.depth = depth + 1
            return loc.exclusive, True
        with self._cond:
            if exclusive:
                self._waiting += 1
                try:
                    while self._exclusive or self._shared:
                        self._cond.wait()
                finally:
                    self._waiting -= 1
                self._exclusive = True
            else:
                while self._exclusive or self._waiting:
                    self._cond.wait()
                self._shared += 1
        loc.depth, loc.exclusive = 1, exclusive
        return exclusive, False

    def exit(self) -> None:
        loc = self._local
        loc.depth -= 1
        if loc.depth:
            return
        with self._cond:
            if loc.exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
            self._cond.notify_all()

    def __enter__(self) -> None:  # the plain lock of ``CPUWorker.compute()``
        self.enter(True)

    def __exit__(self, *exc: object) -> None:
        self.exit()

    def runs_without_draw(self, owner: Any, key: tuple) -> int:
        """Runs alone without a draw so far (``-1``: the stage draws)."""
        entry = self._seen.get(owner)
        return 0 if entry is None else entry.get(key, 0)

    def record(self, owner: Any, key: tuple, drew: bool) -> None:
        with self._seen_lock:
            entry = self._seen.setdefault(owner, {})
            if drew:
                entry[key] = _DRAWS
            elif entry.get(key, 0) != _DRAWS:
                entry[key] = entry.get(key, 0) + 1

    def learned(self, layers: Sequence[Any]) -> list[list[Any]]:
        """What was learned of the stages of these host layers, as rows ``[job kind, first
        layer, end, train mode, runs]``, for a checkpoint: a resumed run that re-learned
        them would run its first microbatches alone, on other thread counts, where the
        run it continues computed side by side."""
        with self._seen_lock:
            return [
                [kind, start, stop, training, runs]
                for layer in layers
                if (entry := self._seen.get(layer))
                for (kind, start, stop, training), runs in sorted(entry.items())
            ]

    def relearn(self, layers: Sequence[Any], rows: Any) -> None:
        """Make what is known of these layers' stages what :meth:`learned` returned
        (``ValueError``, changing nothing, for a row not of a stage of these layers)."""
        n = len(layers)
        table: dict[int, dict[tuple, int]] = {}
        for row in rows if isinstance(rows, (list, tuple)) else [rows]:
            ok = isinstance(row, (list, tuple)) and len(row) == 5
            if ok:
                kind, start, stop, training, runs = row
                ok = (
                    isinstance(kind, str)
                    and all(type(v) is int for v in (start, stop, runs))
                    and 0 <= start < stop <= n
                    and isinstance(training, bool)
                    and runs >= _DRAWS
                )
            if not ok:
                raise ValueError(
                    f"learned stage draws: row {row!r} is not [job kind, first layer, end, "
                    f"train mode, runs >= -1] for a model of {n} layers; it was saved for "
                    "another model"
                )
            table.setdefault(start, {})[(kind, start, stop, training)] = runs
        with self._seen_lock:
            for i, layer in enumerate(layers):
                if i in table:
                    self._seen[layer] = table[i]
                else:
                    self._seen.pop(layer, None)

    def draws_seen(self, layers: Sequence[Any]) -> bool:
        """Whether a stage starting at one of these host layers was seen to draw."""
        with self._seen_lock:
            return any(
                _DRAWS in entry.values()
                for layer in layers
                if (entry := self._seen.get(layer)) is not None
            )


_GATE = ComputeGate()


def _use_threads(worker: CPUWorker, n: int) -> None:
    """This worker thread's intra-op threads (``torch.set_num_threads`` sets the calling
    thread's counts, and new threads start from the last value set: a worker that shared
    the cores sets the full count back when its shared scope ends)."""
    if n > 0 and worker.threads_now != n:
        if not worker.threads_now:
            # ATen gives a thread its count at its first parallel call, from the last count
            # any thread set, over what was set on it before: take that first
            torch.get_num_threads()
        torch.set_num_threads(n)
        worker.threads_now = n


class StageCompute:
    """The scope of one microbatch of a job on a CPU worker that may overlap others: the
    gate in the mode the stage's draws and ``may_share`` (the default lets a replica in a
    blocking call share) allow, its intra-op threads, and the check that the stage drew
    what it was believed to (``check_draws``). ``owner``: the stage's first host layer,
    ``key`` as :class:`ComputeGate`'s."""

    __slots__ = ("worker", "owner", "key", "may_share", "mode", "nested", "entry")

    def __init__(self, worker: CPUWorker, owner: Any, key: tuple, may_share: bool) -> None:
        self.worker, self.owner, self.key = worker, owner, key
        self.may_share = may_share or worker.share_always
        self.mode, self.nested = RNG_ALONE, False
        self.entry: Any = None  # the generator's state where a shared scope began

    def __enter__(self) -> None:
        w = self.worker
        runs = _GATE.runs_without_draw(self.owner, self.key)
        alone = runs < CLEAN_RUNS_BEFORE_SHARING or not (w.has_siblings and self.may_share)
        exclusive, self.nested = _GATE.enter(alone)
        if self.nested:
            return  # the outer scope's mode, threads and checks hold
        if not exclusive:
            self.mode = RNG_SHARED
            _use_threads(w, w.shared_threads)
            self.entry = _CPU_GENERATOR.get_state()
        else:
            self.mode = RNG_WATCH if 0 <= runs < CLEAN_RUNS_BEFORE_SHARING else RNG_ALONE
            if w.concurrent:
                _use_threads(w, w.full_threads)
            if self.mode == RNG_WATCH:
                w.rng_drew, w.rng_probe = False, _CPU_GENERATOR.get_state()
        w.rng_mode = self.mode

    def check_draws(self) -> None:
        """After the stage ran (no error): learn whether it drew (running alone), or fail
        if it drew beside other stages."""
        if self.nested:
            return
        w = self.worker
        if self.mode == RNG_WATCH:
            drew = w.rng_drew or not torch.equal(_CPU_GENERATOR.get_state(), w.rng_probe)
            _GATE.record(self.owner, self.key, drew)
        elif self.mode == RNG_SHARED and not torch.equal(_CPU_GENERATOR.get_state(), self.entry):
            _GATE.record(self.owner, self.key, True)
            kind, start, stop, training = self.key
            raise UnexpectedDrawError(
                f"the CPU random generator moved while the {kind} stage of layers "
                f"{start}..{stop - 1} ({'train' if training else 'eval'} mode) computed "
                "beside other stages: it, or a stage beside "
                "it, drew random numbers although none did in their earlier runs. Such "
                "numbers come from no seeded stream and a recompute cannot replay them, "
                "so this call's gradients would be wrong: it is stopped. The stages that "
                "saw it run alone from now on, so calling again is exact. Causes: a layer "
                "whose randomness depends on its input or on state the engine does not "
                "see (a submodule switched to train mode alone), or another thread drawing "
                "from torch's CPU generator during the call; set ROUNDPIPE_CPU_CONCURRENT=0 "
                "to compute one stage at a time"
            )

    def __exit__(self, *exc: object) -> None:
        w = self.worker
        try:
            if not self.nested:
                w.rng_mode = RNG_ALONE
                w.rng_probe = self.entry = None
                if self.mode == RNG_SHARED:
                    _use_threads(w, w.full_threads)
        finally:
            _GATE.exit()


class CPUWorker(Worker):
    """A thread that plays a device on host memory; the ledger counts what a device would hold."""

    kind = "cpu"
    time_points_are_seconds = True
    lends_host_tensors = True

    #: How many CPU workers of one pool split the host's free memory (the pool sets it).
    share: int = 1

    def __init__(self, index: int) -> None:
        cpu_device_memory_bytes()  # a bad setting fails when the pool is built, not mid-plan
        # set by the pool: whether stages seen not to draw may compute beside others, in
        # every call; intra-op threads alone / beside others (``threads_now``: as last set,
        # 0: never); whether another CPU worker had jobs in the latest submission
        self.concurrent = self.share_always = False
        self.full_threads = self.shared_threads = self.threads_now = 0
        self.has_siblings = False
        # the generator's use in the scope computing now; while a stage's draws are
        # watched, whether it drew and the state to compare
        self.rng_mode = RNG_ALONE
        self.rng_drew = False
        self.rng_probe: Any = None
        super().__init__(index, torch.device("cpu"))

    def copy_in(self, tensors: Sequence[torch.Tensor], channel: str) -> list[torch.Tensor]:
        out = _clones(tensors)
        self.ledger.alloc(sum(map(NBYTES, out)), channel)
        return out

    def lend_in(
        self, tensors: Sequence[torch.Tensor], read_only: Sequence[bool]
    ) -> list[torch.Tensor]:
        # device memory is host memory: a stage that only reads a host tensor computes on
        # it (an alias of its own, so the stage's parameter wrapper and .grad are the
        # stage's); what it may write (buffers) is still copied
        out = _clones(tensors, read_only)
        self.ledger.alloc(sum(map(NBYTES, out)), "param")
        return out

    def copy_out(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # host memory already: what a stage hands out (its outputs, input gradients,
        # losses, buffer copies, gradients it drops) is made by this job and not written
        # after it, and every consumer's copy_in copies again before it may write -- a
        # copy here would only be thrown away (take_out is this too)
        return [t.detach() if t.requires_grad else t for t in tensors]

    def compute(self) -> contextlib.AbstractContextManager:
        return _GATE  # alone (the scope of every stage where workers do not overlap)

    def watch_seed(self, seed: int) -> None:
        """Seed a stream while the stage's draws are watched, noting a draw since the last
        seed (or the scope's start) first."""
        if not self.rng_drew and not torch.equal(_CPU_GENERATOR.get_state(), self.rng_probe):
            self.rng_drew = True
        _CPU_GENERATOR.manual_seed(seed)
        self.rng_probe = _CPU_GENERATOR.get_state()

    def get_rng_state(self) -> Any:
        return _CPU_GENERATOR.get_state()  # torch.get_rng_state(), without its wrapper

    def set_rng_state(self, state: Any) -> None:
        _CPU_GENERATOR.set_state(state)

    def time_point(self) -> Any:
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1000.0

    def memory_capacity(self) -> int:
        return cpu_device_memory_bytes(self.share)
