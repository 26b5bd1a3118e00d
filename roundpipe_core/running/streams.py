"""Random streams of a pipelined call: deterministic, and replayed by every recompute
(docs/numerical-contract.md, "Random numbers").

A stream is seeded only where a *segment* starts -- every start of a forward or a
backward stage (the forward jobs record theirs, before any backward job of the
microbatch; the backward ones are the run's boundaries) -- and runs on through its
layers: a segment lies inside one forward and one backward stage, so the recompute
runs it from its start in the forward's order and draws the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from .devices.base import Worker
from .devices.cpu import RNG_SHARED, RNG_WATCH, CPUWorker, StageCompute

__all__ = ["ComputeScope", "replay_seed", "seed_stream"]


class ComputeScope:
    """``worker.compute()``, autograd on or off (``grad``; ``None`` leaves it), and the
    worker's generator given back on exit (the seeding here must not disturb the random
    stream of the code around RoundPipe), as one object: three nested context managers per
    microbatch cost more than a small stage's own Python work. A CPU worker that may
    overlap others computes in the scope its stage's draws allow (``cpu.StageCompute``)."""

    __slots__ = ("worker", "grad", "compute", "prev", "state")

    def __init__(self, worker: Worker, grad: bool | None, run: Any, job: Any) -> None:
        self.worker = worker
        self.grad = grad
        if isinstance(worker, CPUWorker) and worker.concurrent:
            r = job.layers
            owner = run.layers[r.start]
            key = (str(job.kind), r.start, r.stop, owner.training)
            # by default only the replicas of one stage in a blocking call share the cores
            share = run.caller_waits and job.replicas > 1
            self.compute: Any = StageCompute(worker, owner, key, share)
        else:
            self.compute = worker.compute()
        self.prev = True
        self.state: Any = None

    def __enter__(self) -> None:
        self.compute.__enter__()
        try:
            self.prev = torch.is_grad_enabled()
            if self.grad is not None:
                torch._C._set_grad_enabled(self.grad)
            if getattr(self.worker, "rng_mode", None) != RNG_SHARED:
                self.state = self.worker.get_rng_state()
        except BaseException:
            torch._C._set_grad_enabled(self.prev)
            self.compute.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None and type(self.compute) is StageCompute:
                self.compute.check_draws()  # before the generator is given back
        finally:
            try:
                if self.state is not None:
                    self.worker.set_rng_state(self.state)
            finally:
                torch._C._set_grad_enabled(self.prev)
                self.state = None
                self.compute.__exit__(*exc)


def seed_stream(run: Any, worker: Worker, layer: int, mb: int) -> None:
    """Start the stream of ``layer`` on ``mb``: the worker's generator seeded from
    ``(run.rng_base, layer, mb)`` (the runtime's layer loop decides where a segment starts)."""
    seed = hash((run.rng_base, layer, mb)) & (2**63 - 1)
    if type(worker).set_rng_state is CPUWorker.set_rng_state:
        # CPU workers draw from the process generator (alone, under the compute gate):
        # seeding it in place gives the state of a fresh seeded generator without
        # copying one. Beside other stages nothing draws and nothing is seeded.
        mode = worker.rng_mode  # type: ignore[attr-defined]
        if mode == RNG_SHARED:
            return
        if mode == RNG_WATCH:
            worker.watch_seed(seed)  # type: ignore[attr-defined]
        else:
            torch.default_generator.manual_seed(seed)
    else:
        gen = torch.Generator(device=worker.device)
        gen.manual_seed(seed)
        worker.set_rng_state(gen.get_state())


def replay_seed(run: Any, worker: Worker, layer: int, mb: int) -> None:
    """Before a recompute of one layer: the forward's stream again where a segment starts
    (``preserve_rng_state``), else fresh numbers."""
    if run.preserve_rng_state and (run.seed_every_layer or layer in run.stream_starts):
        seed_stream(run, worker, layer, mb)
