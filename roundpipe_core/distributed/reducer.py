"""Master weights and gradients across ranks: bucketed gradient all-reduce (optionally
overlapped with the backward through RoundPipe's grad hook), and broadcasting / checking
the master weights. Buckets travel in a small ring of flat host buffers (``buckets.py``);
gloo reduces them in place, an NCCL group stages each through its GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..kinds import check_int
from .buckets import (
    DEFAULT_BUCKET_BYTES,
    REDUCE_IN_FLIGHT,
    BufferRing,
    _Bucket,
    _bucketize,
    _unique_params,
    copy_from_flat,
)
from .group import (
    all_gather,
    collective,
    collective_error,
    comm_device,
    destroy_group,
    group_size,
    is_nccl,
    new_group,
    resolve_timeout,
)

__all__ = [
    "GradientAllReducer",
    "sync_gradients",
    "broadcast_masters",
    "params_in_sync",
]


#: How gradients combine over ranks.
REDUCE_OPS = ("mean", "sum")


def check_reduce_arguments(op: object, bucket_bytes: object) -> None:
    """ValueError unless ``op`` is one of :data:`REDUCE_OPS` and ``bucket_bytes`` an int >= 1."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    check_int(bucket_bytes, "bucket_bytes")


_POLL_S = 0.05  # how often waiting threads look for an abort


def broadcast_masters(
    rp: Any, src: int = 0, group: Any | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Make every rank hold rank ``src``'s masters, frozen parameters and buffers
    (BatchNorm statistics), then copy the masters into the model. Collective: call it
    on every rank after building the RoundPipe (or loading a checkpoint on one rank)."""
    if group_size(group) == 1:
        return
    rp.synchronize()  # no step in flight writes the masters while we overwrite them
    tensors: list[torch.Tensor] = list(rp.optim_parameters())
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
    for p in rp.model.parameters():
        m = rp.master_param(p)
        if m is None:
            tensors.append(p)
        else:
            pairs.append((p, m))
    tensors.extend(
        b for b in rp.model.buffers() if b.is_floating_point() or b.dtype in (torch.long, torch.int)
    )
    dev = comm_device(group)
    for bucket in _bucketize(tensors, bucket_bytes):
        flat = torch.cat([t.detach().reshape(-1).to(dev) for t in bucket])
        with collective(f"broadcast of rank {src}'s weights", group):
            dist.broadcast(flat, src=src, group=group)
        copy_from_flat(flat, bucket)
    with torch.no_grad():
        for p, m in pairs:
            p.copy_(m)


def params_in_sync(rp: Any, group: Any | None = None) -> bool:
    """True when every rank holds bit-identical masters (the model's trainable weights
    where a sharded state released them): a debugging aid, one all-gather of checksums.
    Collective."""
    if group_size(group) == 1:
        return True
    masters = getattr(rp, "masters", None)
    held = (
        [p for p in rp.model.parameters() if p.requires_grad]
        if masters is not None and masters.released
        else rp.optim_parameters()
    )
    sums = torch.zeros(max(len(held), 1), 3, dtype=torch.float64)
    for i, m in enumerate(held):
        x = m.detach().double().reshape(-1)
        weights = torch.arange(1, x.numel() + 1, dtype=torch.float64)
        sums[i] = torch.stack([x.sum(), x.abs().sum(), (x * weights).sum()])
    everyone = all_gather(sums, group)
    return bool((everyone == everyone[0:1]).all())


class _Round:
    """One reduction: readiness of each bucket, the worker thread, the first error."""

    def __init__(self, buckets: list[_Bucket], ring: BufferRing) -> None:
        self.ring = ring  # the reducer's flat buffers this round fills
        self.remaining = [len(b.params) for b in buckets]
        self.ready = [threading.Event() for _ in buckets]
        self.fired: set[int] = set()
        self.aborted = threading.Event()
        self.error: BaseException | None = None
        self.misuse: RuntimeError | None = None
        self.thread: threading.Thread | None = None

    def set_all_ready(self) -> None:
        for e in self.ready:
            e.set()


class GradientAllReducer:
    """All-reduce RoundPipe's master gradients over a process group.

    Buckets hold the masters in *reverse* parameter order (the deepest gradients are
    complete first) and are reduced in that fixed order from one thread per round, so
    every rank issues the same collectives in the same order whatever order its grad
    hooks fire in. At most :data:`REDUCE_IN_FLIGHT` are in flight, in a ring of kept flat
    host buffers (``buckets.BufferRing``, :attr:`kept_bytes`). Usage: docs/multi-node.md
    (:meth:`arm` before the window's last backward, :meth:`finish` before the step).

    Args:
        rp: the ``RoundPipe`` whose ``optim_parameters()`` gradients are reduced.
        process_group: the group to reduce over. Default: a new gloo group of its own
            (made collectively: every rank builds its reducers in one order), so the
            training loop's collectives on the default group (``sync_dist=True``,
            barriers) never interleave with the reducer thread's. Pass a group only if
            nothing else uses it while a round is armed. In one process: a no-op.
        op: "mean" (divide the sum by the world size, as DDP) or "sum".
        bucket_bytes: gradient bytes per collective.
        overlap: register a grad hook so an armed round starts reducing a bucket as
            soon as its gradients are complete.
        params: the tensors whose ``.grad`` is reduced (default ``rp.optim_parameters()``);
            tensors outside RoundPipe are reduced too, only never early.
        timeout: bound on every collective of its own group (default:
            :func:`~.group.new_group`'s); with an explicit ``process_group``, on waiting
            for each all-reduce (default: that group's own timeout).
    """

    def __init__(
        self,
        rp: Any,
        process_group: Any | None = None,
        op: str = "mean",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        timeout: float | int | timedelta | None = None,
        params: Iterable[torch.Tensor] | None = None,
    ) -> None:
        check_reduce_arguments(op, bucket_bytes)
        if not hasattr(rp, "optim_parameters") or not hasattr(rp, "register_grad_hook"):
            raise TypeError(f"GradientAllReducer needs a RoundPipe, got {type(rp).__name__}")
        self.rp = rp
        self.op = op
        self.overlap = bool(overlap)
        self._owns_group = process_group is None and group_size(None) > 1
        if self._owns_group:
            process_group = new_group(timeout)
            self.timeout = None  # the group's own timeout bounds every collective
        else:
            self.timeout = None if timeout is None else resolve_timeout(timeout)
        self.group = process_group
        # fixed at construction: a reducer built before the process group stays a no-op
        self.world_size = group_size(process_group)
        params = list(reversed(_unique_params(rp.optim_parameters() if params is None else params)))
        self.buckets = [
            _Bucket(i, b) for i, b in enumerate(self._group_params(params, bucket_bytes))
        ]
        self._slot = {id(p): b.index for b in self.buckets for p in b.params}
        self._ring = BufferRing(self.buckets)  # the flat buffers, kept across rounds
        self._lock = threading.Lock()
        # The masters' lock on their .grad, held while a bucket is read or written back:
        # synchronize() may replace a .grad meanwhile, and that race can segfault.
        masters = getattr(rp, "masters", None)
        self._grad_lock = getattr(masters, "grad_lock", None) or threading.Lock()
        self._round: _Round | None = None
        self._remove_hook = rp.register_grad_hook(self._on_grads_ready) if self.overlap else None
        self._closed = False
        self.last_finish_wait_s = 0.0
        """Seconds the last ``finish()`` blocked the caller (the exposed communication)."""

    def kept_buffers(self) -> list[torch.Tensor]:
        """The flat host buffers kept between rounds (none before the first round)."""
        return self._ring.buffers()

    @property
    def kept_bytes(self) -> int:
        """Host bytes of :meth:`kept_buffers` (:func:`~.buckets.reduce_buffer_bytes`)."""
        return sum(t.untyped_storage().nbytes() for t in self.kept_buffers())

    def arm(self) -> None:
        """Start a round now: buckets are reduced as the grad hook reports them complete.

        Call it right before the *last* gradient-producing call of the optimizer step.
        A no-op with ``overlap=False`` or world size 1.

        Raises:
            RuntimeError: a round is already armed (call ``finish()`` first).
        """
        self._check_open()
        if self._round is not None:
            raise RuntimeError(
                "GradientAllReducer.arm() called twice; call finish() after each arm()"
            )
        if not self.overlap or self.world_size == 1:
            return
        rnd = _Round(self.buckets, self._ring)
        rnd.thread = threading.Thread(
            target=self._reduce, args=(rnd,), daemon=True, name="roundpipe-allreduce"
        )
        with self._lock:
            self._round = rnd
        rnd.thread.start()

    def _on_grads_ready(self, masters: list[nn.Parameter]) -> None:
        """Grad hook (a worker thread): mark masters complete; release full buckets."""
        with self._lock:
            rnd = self._round
            if rnd is None:
                return
            for m in masters:
                slot = self._slot.get(id(m))
                if slot is None:
                    continue
                if id(m) in rnd.fired:
                    if rnd.misuse is None:
                        rnd.misuse = RuntimeError(
                            "a master gradient changed after its all-reduce had started: arm() must come "
                            "right before the LAST backward (forward_backward) of the optimizer step, "
                            "not earlier in the accumulation window"
                        )
                    continue
                rnd.fired.add(id(m))
                rnd.remaining[slot] -= 1
                if rnd.remaining[slot] == 0:
                    rnd.ready[slot].set()

    def _reduce(self, rnd: _Round) -> None:
        """Issue one async all-reduce per bucket in the fixed order, then wait for each
        and write the result back into ``.grad``. Errors are kept for ``finish()``."""
        # (host slot, what the collective reduces: the slot, or its copy on an NCCL GPU)
        pending: list[tuple[_Bucket, torch.Tensor, torch.Tensor, Any]] = []
        try:
            # A step in flight reads and clears the grads; a master of a stage that made
            # no gradient is reported without waiting for it, so wait here (unless this
            # is the optimizer thread, where every earlier step has run).
            if not self.rp._home()._steps.on_optimizer_thread():
                self.rp.wait_step()
            divisor = self.world_size if self.op == "mean" else 1

            def land_oldest() -> None:
                b, host, sent, work = pending.pop(0)
                if self.timeout is None:
                    work.wait()
                else:
                    work.wait(self.timeout)
                if sent is not host:
                    # NCCL: blocking copy back on the upload's stream, so the slot is
                    # free for a later bucket once it returns
                    host.copy_(sent)
                with self._grad_lock:
                    self._land(b, host, divisor)

            for b in self.buckets:
                while not rnd.ready[b.index].wait(_POLL_S):
                    if rnd.aborted.is_set():
                        return
                if rnd.aborted.is_set():
                    return  # do not issue a collective our peers may never match
                # this slot's previous bucket landed (REDUCE_IN_FLIGHT + 1 places back)
                with self._grad_lock:
                    host = b.flatten(rnd.ring.slot(b))
                sent = host
                if is_nccl(self.group):
                    sent = host.to(comm_device(self.group), non_blocking=True)
                pending.append((b, host, sent, self._issue(b, sent)))
                while len(pending) > REDUCE_IN_FLIGHT:
                    land_oldest()  # the ring has one slot more than buckets in flight
            while pending:
                land_oldest()
        except BaseException as exc:  # noqa: BLE001 - handed to finish() on the caller's thread
            rnd.error = rnd.error or exc
        finally:
            if pending:  # aborted or failed with collectives in flight on its slots
                self._retire_ring(rnd)

    def _retire_ring(self, rnd: _Round) -> None:
        """Give later rounds a new ring: ``rnd``'s collectives may still write its slots."""
        if self._ring is rnd.ring:
            self._ring = BufferRing(self.buckets)

    # what a sharded reducer overrides: the buckets, their collective, the result's use
    def _group_params(
        self, params: list[torch.Tensor], bucket_bytes: int
    ) -> list[list[torch.Tensor]]:
        return _bucketize(params, bucket_bytes)

    def _issue(self, bucket: _Bucket, buf: torch.Tensor) -> Any:
        return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def _land(self, bucket: _Bucket, buf: torch.Tensor, divisor: int) -> None:
        bucket.unflatten(buf, divisor)

    def finish(self) -> None:
        """Complete the reduction: every master's ``.grad`` is then the sum (or mean) over
        ranks. Collective: once per optimizer step on every rank, skipped steps included.

        Raises:
            RuntimeError: a collective failed or timed out (a peer died or stalled), or
                the overlap was armed too early; the original error is chained.
        """
        self._check_open()
        start = time.perf_counter()
        with self._lock:
            rnd, self._round = self._round, None
        if self.world_size == 1:
            return
        if rnd is None:
            rnd = _Round(self.buckets, self._ring)
            rnd.set_all_ready()
            self._reduce(rnd)
        else:
            rnd.set_all_ready()
            assert rnd.thread is not None
            while rnd.thread.is_alive():
                rnd.thread.join(0.5)  # short joins keep Ctrl-C working
        self.last_finish_wait_s = time.perf_counter() - start
        if rnd.misuse is not None:
            raise rnd.misuse
        if rnd.error is not None:
            raise collective_error("gradient all-reduce", rnd.error, self.group) from rnd.error

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this GradientAllReducer is closed; make a new one")

    def abort(self) -> None:
        """Drop an armed round without further collectives (after a failed call); peers
        waiting on this rank fail at the group's timeout."""
        with self._lock:
            rnd, self._round = self._round, None
        if rnd is not None:
            rnd.aborted.set()
            rnd.set_all_ready()
            self._retire_ring(rnd)

    def close(self) -> None:
        """Abort any armed round, remove the grad hook and free the reducer's own group."""
        self._closed = True
        self.abort()
        self._ring = BufferRing(self.buckets)
        if self._remove_hook is not None:
            self._remove_hook()
            self._remove_hook = None
        if self._owns_group:
            group, self.group = self.group, None
            destroy_group(group)

    def __enter__(self) -> GradientAllReducer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sync_gradients(
    rp: Any, group: Any | None = None, op: str = "mean", bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """All-reduce ``rp``'s master gradients now, on the default group (the caller's
    thread needs no group of its own, which would cost a rendezvous a step). Collective."""
    if group is None and group_size(None) > 1:
        group = dist.group.WORLD
    with GradientAllReducer(rp, group, op=op, bucket_bytes=bucket_bytes, overlap=False) as reducer:
        reducer.finish()
