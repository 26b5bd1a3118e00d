"""Chunked parameter uploads: cut copies into pieces and feed them to a stream a few at a
time (``cuda.py``'s parameter stream). Free of CUDA calls: tested on CPU with fake events.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FEEDER_TIMEOUT_S", "ChunkFeeder", "Piece", "plan_chunks"]

#: Host waits on the feeder give up after this many seconds (a hang is a bug).
FEEDER_TIMEOUT_S = 600.0

Piece = tuple[int, int, int]  # (tensor index, first element, end element)


def plan_chunks(
    numels: Sequence[int], element_sizes: Sequence[int], chunk_bytes: int
) -> list[list[Piece]]:
    """Cut the copies of tensors (``numels`` elements of ``element_sizes`` bytes each)
    into units of ``(tensor index, start, stop)`` element ranges of at most
    ``chunk_bytes`` bytes (unless one element is larger): small tensors share a unit
    (one feeder step), a large one is split; every element covered once, in order."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if len(numels) != len(element_sizes):
        raise ValueError(
            f"got {len(numels)} element counts but {len(element_sizes)} element sizes; "
            "give one element size per tensor"
        )
    units: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for i, (n, esize) in enumerate(zip(numels, element_sizes)):
        start = 0
        while start < n:
            room = chunk_bytes - used
            take = min(n - start, max(room // esize, 0))
            if take == 0:
                if current:  # unit full: close it and retry in a fresh one
                    units.append(current)
                    current, used = [], 0
                    continue
                take = 1  # a single element larger than a chunk
            current.append((i, start, start + take))
            used += take * esize
            start += take
            if used >= chunk_bytes:
                units.append(current)
                current, used = [], 0
    if current:
        units.append(current)
    return units


class ChunkFeeder:
    """Issues batches of copy units in order on one stream (a thread named ``name``;
    ``thread_init`` runs on it first), at most ``depth`` units in flight, so work on
    other streams (activation uploads) never queues behind more. A *unit* is a callable
    that enqueues asynchronous work and returns a token with ``synchronize()`` (a CUDA
    event recorded after it)."""

    def __init__(
        self, name: str, depth: int, thread_init: Callable[[], None] | None = None
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._thread_init = thread_init
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, list[Callable[[], Any]]]] = collections.deque()
        self._submitted = 0  # last ticket handed out
        self._issued = 0  # last ticket whose units are all enqueued
        self._tokens: dict[int, Any] = {}  # ticket -> token of its last unit
        self._error: BaseException | None = None
        self._closed = False
        self.max_inflight_seen = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, units: list[Callable[[], Any]]) -> int:
        """Queue a batch of units; returns its ticket (tickets increase by one)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the parameter feeder is closed")
            self._raise_if_failed()
            self._submitted += 1
            ticket = self._submitted
            self._queue.append((ticket, units))
            self._cv.notify_all()
            return ticket

    @property
    def last_ticket(self) -> int:
        with self._cv:
            return self._submitted

    def wait_issued(
        self, ticket: int, timeout: float = FEEDER_TIMEOUT_S, prune: bool = True
    ) -> Any:
        """Block until batch ``ticket`` is enqueued; its last unit's token (``None`` if
        nothing was issued). Earlier batches' tokens are dropped (the latest implies them)
        unless ``prune`` is False (a caller on another thread must not make the worker's
        own waits coarser)."""
        with self._cv:
            ok = self._cv.wait_for(
                lambda: self._issued >= ticket or self._error is not None, timeout
            )
            self._raise_if_failed()
            if not ok:
                raise TimeoutError(f"parameter upload batch {ticket} not issued after {timeout} s")
            # Stream order: a later batch's token implies this one, so an older ticket
            # whose token was pruned is answered with the nearest later token.
            later = [t for t in self._tokens if t >= ticket]
            token = self._tokens[min(later)] if later else None
            if prune:
                for t in [t for t in self._tokens if t < ticket]:
                    del self._tokens[t]
            return token

    def close(self, timeout: float = 10.0) -> bool:
        """Issue the batches submitted, then stop (waits up to ``timeout`` s); whether the
        thread ended, every unit issued."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"parameter upload failed: {self._error!r}") from self._error

    def _loop(self) -> None:
        try:
            if self._thread_init is not None:
                self._thread_init()
            inflight: collections.deque[Any] = collections.deque()
            # An empty batch is answered with the last unit's token: it implies
            # everything issued before it on the stream.
            token = None
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._queue or self._closed)
                    if not self._queue:
                        return  # closed and drained
                    ticket, units = self._queue.popleft()
                for unit in units:
                    while len(inflight) >= self.depth:
                        inflight.popleft().synchronize()
                    token = unit()
                    inflight.append(token)
                    self.max_inflight_seen = max(self.max_inflight_seen, len(inflight))
                # The units hold views of the stage's device tensors: let them go now, not
                # when the next batch arrives, or the last stage uploaded stays allocated
                # on the GPU after the runtime released it.
                units = unit = None  # type: ignore[assignment]
                with self._cv:
                    self._tokens[ticket] = token
                    self._issued = ticket
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter
            with self._cv:
                self._error = exc
                self._cv.notify_all()
