"""Weight versions: which step's weights the host copy of each parameter holds.

The host copy of the model's parameters is what devices upload; version v holds the
weights of step v (0: the initial ones). A run that overlaps others, or a blocking call
issued while the optimizer thread still copies a step's weights into the model, reads
one version. A parameter's new version is copied into the host copy (*published*) only
after every older-version run holding it has uploaded it and those uploads' fences
returned (a CPU worker computes on the host tensors, so its fence waits until the stage
is released); an upload waits until its run's version is published. Tied parameters:
all layers holding one are waited for.

The publication runs on the optimizer thread; the readers are the workers' uploads
(``transfer.upload_job``). One condition variable guards the state; it is never held
while copying.

A *remote publisher* (:class:`RemotePublisher`) publishes masters whose values this
process does not hold (a data-parallel rank sharding the host state: their owners
broadcast each version into the model, ``distributed/sharded.py``): all its masters of
a version in one collective sequence, exactly once per version on every rank, claiming
each part from here -- the same wait for older readers as a local copy.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

from torch import nn

from ..running.devices.pool import PoolError
from .masters import copy_pairs

__all__ = ["RemotePublisher", "WeightVersions"]

_WAIT_SLICE_S = 0.05


class RemotePublisher(Protocol):
    """Publishes some masters' versions into the model from elsewhere (another rank's
    masters): see the module docstring."""

    @property
    def keys(self) -> Sequence[int]:
        """Ids of the masters it publishes."""
        ...

    def publish(
        self,
        version: int,
        claim: Callable[[Sequence[int]], None],
        mark: Callable[[Sequence[int]], None],
    ) -> None:
        """Write version ``version`` of all its masters into the model: ``claim(keys)``
        before writing those masters' weights (it blocks until no older reader needs
        them), ``mark(keys)`` once they are written."""
        ...


def _settled(fence: Callable[[], None]) -> bool:
    """Whether ``fence`` says it would return at once (a fence may have ``settled()``)."""
    settled = getattr(fence, "settled", None)
    return settled is not None and settled()


class _Reader:
    """A pipelined run as a reader of weight version ``version``: how many of its
    jobs still have to upload each layer, and the fences of the uploads issued.
    ``gate``: a blocking call issued while the optimizer thread still copies a step's
    weights into the model (that work's future, and whether the pipelined path failed):
    its wait stops at a failure, and once that copy ended (without copying: the call
    reads the last completed step's weights)."""

    def __init__(
        self,
        version: int,
        counts: dict[int, int],
        gate: tuple[Future, Callable[[], bool]] | None = None,
    ) -> None:
        self.version = version
        self.pending = counts
        # (layers, fence) per upload issued, not per layer: a run's end walks them all
        self.fences: list[tuple[Sequence[int], Callable[[], None]]] = []
        self.gate = gate


class WeightVersions:
    """Which step's weights the host copy of each trainable parameter holds, and which
    pipelined runs still have to upload it.

    Args:
        layers: the model's layers.
        masters: ``(name, model_param, master_param)`` of the trainable parameters.
        released: ids of released masters (the live set): never copied into the model.
        publishers: the remote publishers (the live list), run first at each publication.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        masters: Sequence[tuple[str, nn.Parameter, nn.Parameter]],
        released: set[int] | None = None,
        publishers: list[RemotePublisher] | None = None,
    ) -> None:
        self._released = released if released is not None else set()
        self._publishers = publishers if publishers is not None else []
        master_of = {id(p): (p, m) for _, p, m in masters}
        self.cond = threading.Condition()  # notified on every upload, publication, run end
        # per layer: the (model param, master) pairs it holds; per master: the layers holding it
        self.layer_pairs: list[list[tuple[nn.Parameter, nn.Parameter]]] = []
        self.holders: dict[int, list[int]] = {}
        self._pair: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        for i, layer in enumerate(layers):
            # (parameters() deduplicates within the layer)
            pairs = [master_of[id(p)] for p in layer.parameters() if id(p) in master_of]
            for pm in pairs:
                self.holders.setdefault(id(pm[1]), []).append(i)
                self._pair[id(pm[1])] = pm
            self.layer_pairs.append(pairs)
        self.version: dict[int, int] = {k: 0 for k in self._pair}
        # masters per version held, and the oldest one held: a run reading no newer version
        # finds its layers ready without walking their masters (one test per job, no lock)
        self._holding: dict[int, int] = {0: len(self.version)} if self.version else {}
        self.floor = 0
        self._readers: list[_Reader] = []
        # fences of uploads that runs which ended (an aborted one too) had issued: the
        # next publication waits for them, so it never rewrites a host copy under a DMA
        self._ended_fences: list[Callable[[], None]] = []

    # -- readers (worker threads) ----------------------------------------------------
    def register(
        self,
        version: int,
        job_layers: Sequence[range],
        gate: tuple[Future, Callable[[], bool]] | None = None,
    ) -> _Reader:
        """A run that reads ``version`` and uploads each of ``job_layers`` once."""
        reader = _Reader(version, Counter(itertools.chain.from_iterable(job_layers)), gate)
        with self.cond:
            self._readers.append(reader)
        return reader

    def _ready(self, reader: _Reader, layers: Sequence[int]) -> bool:
        return all(
            self.version[id(m)] >= reader.version for i in layers for _, m in self.layer_pairs[i]
        )

    def wait_ready(
        self, reader: _Reader, layers: Sequence[int], failed: Callable[[], bool], block: bool = True
    ) -> bool:
        """Whether ``layers`` hold ``reader``'s version (or its gate opened), blocking until
        they do unless ``block`` is False; blocking, PoolError once ``failed()``."""
        if self.floor >= reader.version:  # (the floor only rises: seen without the lock)
            return True
        gate = reader.gate
        with self.cond:
            while not self._ready(reader, layers):
                if block and (failed() or (gate is not None and gate[1]())):
                    raise PoolError("stopped waiting for weights to upload: the run was aborted")
                if gate is not None and gate[0].done():
                    return True
                if not block:
                    return False
                self.cond.wait(_WAIT_SLICE_S)
        return True

    def uploaded(self, reader: _Reader, layers: Sequence[int], fence: Callable[[], None]) -> None:
        """``reader`` issued the upload of ``layers``; ``fence()`` blocks until the host copy
        may change under it (read by a device; released, where it computes on the host's)."""
        with self.cond:
            for i in layers:
                reader.pending[i] -= 1
            reader.fences.append((layers, fence))
            self.cond.notify_all()

    def finish(self, reader: _Reader) -> None:
        """The run is over (done, failed or aborted): it uploads nothing more."""
        with self.cond:
            if reader in self._readers:
                self._readers.remove(reader)
                self._ended_fences.extend(f for _, f in reader.fences if not _settled(f))
            self.cond.notify_all()

    # -- publication (optimizer thread) ------------------------------------------------
    def _blocked(self, mid: int, version: int) -> bool:
        return any(
            r.version < version and r.pending.get(i, 0) > 0
            for r in self._readers
            for i in self.holders[mid]
        )

    def publish(self, version: int, failed: Callable[[], bool]) -> None:
        """Copy the masters (step ``version``'s weights) into the model, each parameter
        as soon as no older-version run has still to upload it; the remote publishers'
        masters first (:meth:`publish_remote`)."""
        self.publish_remote(version, failed)
        todo = self.stale(version)
        while todo:
            with self.cond:
                while True:
                    if failed():
                        raise PoolError("weight publication stopped: a pipelined iteration failed")
                    if self.any_publishable(version, todo):
                        break
                    self.cond.wait(_WAIT_SLICE_S)
            todo = self.publish_ready(version, todo)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def stale(self, version: int) -> list[int]:
        """The masters (ids) whose host copy holds a version older than ``version``."""
        with self.cond:
            return [k for k, v in self.version.items() if v < version]

    def any_publishable(self, version: int, todo: Sequence[int]) -> bool:
        """Whether one of ``todo`` may be published now (call with ``cond`` held)."""
        return any(not self._blocked(k, version) for k in todo)

    def publish_ready(self, version: int, todo: Sequence[int]) -> list[int]:
        """Publish those of ``todo`` that no older-version run still has to upload (does
        not wait for uploads); return the others."""
        with self.cond:
            ready = [k for k in todo if not self._blocked(k, version)]
            if not ready:
                return list(todo)
        self._wait_old_uploads(version, ready)
        # shallow layers first, each usable as soon as it is copied: the next
        # iteration's first forward waits for its own layer only, not for the copy
        # of the whole model
        ready.sort(key=lambda k: self.holders[k][0])
        for _, layer_keys in itertools.groupby(ready, key=lambda k: self.holders[k][0]):
            # a layer's parameters, then one wake-up of the workers waiting for that
            # layer (a wake-up per tensor costs every waiting worker a lock round each)
            keys = list(layer_keys)
            # a shared master already is the weight: the step wrote it; a released one
            # has no values (its owner's reached the model)
            pairs = [self._pair[k] for k in keys if k not in self._released]
            copy_pairs([pm for pm in pairs if pm[0] is not pm[1]])
            self._mark(keys, version)
        done = set(ready)
        return [k for k in todo if k not in done]

    def _wait_old_uploads(self, version: int, keys: Sequence[int]) -> None:
        """Run the fences of the uploads of ``keys`` by older-version runs and by the
        runs that ended: after it the host copy of ``keys`` may change."""
        layers = {i for k in keys for i in self.holders[k]}
        with self.cond:
            fences = [
                f
                for r in self._readers
                if r.version < version
                for held, f in r.fences
                if not layers.isdisjoint(held)
            ]
            ended, self._ended_fences = self._ended_fences, []
        for fence in fences:  # async (CUDA) uploads must have read the host copy
            fence()
        for fence in ended:
            # an aborted run's failed upload raises its error here; that run reports it
            with contextlib.suppress(Exception):
                fence()

    def _mark(self, keys: Sequence[int], version: int) -> None:
        with self.cond:
            for k in keys:
                old = self.version[k]
                if old != version:
                    self._holding[old] -= 1
                    if not self._holding[old]:
                        del self._holding[old]
                    self._holding[version] = self._holding.get(version, 0) + 1
                    self.version[k] = version
            self.floor = min(self._holding, default=version)
            self.cond.notify_all()

    # -- remote publication (the optimizer thread, or synchronize()) --------------------------
    def publish_remote(self, version: int, failed: Callable[[], bool]) -> None:
        """Run each remote publisher (see the module docstring) whose masters do not
        hold ``version`` yet; it waits, part by part, until no older-version run still
        has to upload them (PoolError once ``failed()``)."""

        def claim(part: Sequence[int]) -> None:
            part = [k for k in part if k in self.version]
            with self.cond:
                while any(self._blocked(k, version) for k in part):
                    if failed():
                        raise PoolError("weight publication stopped: a pipelined iteration failed")
                    self.cond.wait(_WAIT_SLICE_S)
            self._wait_old_uploads(version, part)

        def mark(part: Sequence[int]) -> None:
            self._mark([k for k in part if k in self.version], version)

        for pub in list(self._publishers):
            keys = [k for k in pub.keys if k in self.version]
            with self.cond:
                if all(self.version[k] >= version for k in keys):
                    continue  # published already (a synchronize() before this step's)
            pub.publish(version, claim, mark)

    def remote_keys(self) -> set[int]:
        """Ids of the masters the remote publishers publish (nobody else copies them)."""
        return {k for pub in self._publishers for k in pub.keys}

    def wait_ended_uploads(self) -> None:
        """Block until the uploads of runs that ended have read the host copy (before the
        whole copy is overwritten, ``set_all``)."""
        self._wait_old_uploads(0, ())  # (no run reads a version older than 0)

    def set_all(self, version: int) -> None:
        """The host copy was overwritten with the masters (``synchronize()``)."""
        self._mark(list(self.version), version)
