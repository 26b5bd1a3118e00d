"""RoundPipe's defaults beside torch's own pipeline (``torch.distributed.pipelining``) on CPU.

    python benchmarks/peer_pipeline.py [--rounds 7] [--steps 4] [--width 1024] [--blocks 16]
                                       [--batch 256] [--microbatches 4]
    python benchmarks/peer_pipeline.py --quick      # tiny shapes, 2 rounds: a smoke run

One model for every variant: ``--blocks`` x (Linear(width) + GELU), seeded alike, the
same batch (``--batch`` rows of input and target, from one seeded generator) cut into
``--microbatches`` equal microbatches, loss ``mean((out - y) ** 2)`` per microbatch and
the *sum* of the microbatch losses backpropagated, then a synchronous fused AdamW step.
Every variant gets 2 CPU threads in total:

* ``plain``: PyTorch in this process, ``torch.set_num_threads(2)``;
* ``plain + checkpoint``: the same with every block under ``torch.utils.checkpoint``
  (``use_reentrant=False``): each block's forward runs again in the backward;
* ``peer GPipe`` / ``peer 1F1B``: ``torch.distributed.pipelining`` with a
  ``PipelineStage`` per rank (the first half of the blocks on rank 0, the second half
  on rank 1) and ``ScheduleGPipe`` / ``Schedule1F1B`` (``scale_grads=False``: the
  microbatch losses are summed, as above), on 2 gloo ranks on this host (a file
  rendezvous in a temporary directory). The ranks are 2 CPU processes this benchmark
  starts (forked where the OS allows, else spawned), with **1 intra-op thread each**;
  they live for the whole run (per schedule kind, its own process group, stage, copy
  of the model and optimizer) and the parent drives them over a pipe, so their rounds
  interleave with the others';
* ``rp cpu:1`` / ``rp cpu:2``: ``RoundPipe(model, devices=...)`` with its defaults
  (default plan; ``ROUNDPIPE_CPU_CONCURRENT`` unset: in these blocking calls CPU
  workers compute stages that draw no random numbers side by side, and the one-stage
  plan runs as one job per worker at once, half the microbatches each, once its stage
  was seen not to draw), ``torch.set_num_threads(2)``, ``forward_backward`` then
  ``step(update, is_async=False)`` over ``optim_parameters()``;
* ``rp cpu:2 one at a time``: the same with ``ROUNDPIPE_CPU_CONCURRENT=0`` for its pool
  (every stage alone, on both threads: the default before it shared the cores).

Before timing, every variant runs one step and prints its step-0 loss; they must
agree (relative 1e-5), else the benchmark stops: the variants do the same
arithmetic. The step-1 losses (after one optimizer step) are printed and checked
alike after the timing. Then ``--rounds`` rounds, each running ``--steps`` steps of
every variant in turn (the order rotates per round, ``benchmarks/_interleave.py``).

Printed: median ms per step and [p25..p75] over rounds, each variant's ratio to
``plain`` per round (median and spread), and the targets of issue 22: RoundPipe on
``cpu:2`` at most 1.0x the 1F1B peer and at most 1.05x RoundPipe on ``cpu:1``; then
the jobs each RoundPipe variant's last call ran.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import multiprocessing as mp
import os
import statistics
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist
from _interleave import interleave
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.checkpoint import checkpoint

LR = 1e-4
LOSS_RTOL = 1e-5
PEER_REPLY_TIMEOUT_S = 600.0
PEER_SCHEDULES = ("GPipe", "1F1B")
CONCURRENT_ENV = "ROUNDPIPE_CPU_CONCURRENT"


@dataclass(frozen=True)
class Shape:
    width: int
    blocks: int
    batch: int
    microbatches: int


def _model(shape: Shape) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(shape.width, shape.width), nn.GELU())
            for _ in range(shape.blocks)
        ]
    )


def _data(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch, the same in every process (its own generator, not the global seed)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.batch, shape.width, generator=gen)
    return x, torch.randn(shape.batch, shape.width, generator=gen)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# A variant runs ``n`` training steps and returns the loss of the first of them.
Runner = Callable[[int], float]


def _plain(shape: Shape, checkpointed: bool) -> Runner:
    model = _model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    x, y = _data(shape)

    def forward(a: torch.Tensor) -> torch.Tensor:
        if not checkpointed:
            return model(a)
        for block in model:
            a = checkpoint(block, a, use_reentrant=False)
        return a

    def run(steps: int) -> float:
        first = float("nan")
        for i in range(steps):
            pairs = zip(x.chunk(shape.microbatches), y.chunk(shape.microbatches))
            loss = torch.stack([_loss(forward(a), b) for a, b in pairs]).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i == 0:
                first = loss.item()
        return first

    return run


def _roundpipe(
    shape: Shape, devices: str, switch: str | None = None
) -> tuple[Runner, Callable[[], None], Callable[[], str]]:
    """The variant's runner, its ``close`` and what its last call ran (its jobs: stage
    kind device, layers, microbatches)."""
    from roundpipe_core import RoundPipe, RoundPipeRunConfig

    before = os.environ.get(CONCURRENT_ENV)
    os.environ.pop(CONCURRENT_ENV, None)  # read when the pool is built
    if switch is not None:
        os.environ[CONCURRENT_ENV] = switch
    try:
        rp = RoundPipe(
            _model(shape),
            devices=devices,
            model_run_config=RoundPipeRunConfig(num_microbatch=shape.microbatches),
        )
    finally:
        if before is None:
            os.environ.pop(CONCURRENT_ENV, None)
        else:
            os.environ[CONCURRENT_ENV] = before
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=LR, fused=True)
    x, y = _data(shape)

    def update() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def run(steps: int) -> float:
        first = float("nan")
        for i in range(steps):
            loss = rp.forward_backward((x,), label=y, loss_fn=_loss)
            rp.step(update, is_async=False)
            if i == 0:
                first = float(loss)
        return first

    def ran() -> str:
        return " ".join(
            f"{j.code}[layers {j.layers.start}-{j.layers.stop - 1}, "
            f"mb {j.microbatches.start}-{j.microbatches.stop - 1}]"
            for j in rp.last_call.schedule
        )

    return run, rp.close, ran


def _peer_rank(rank: int, shape: Shape, store: str, conn: Connection) -> None:
    """One pipeline rank: its half of the model once per schedule kind, then serve
    ``(schedule, steps)`` requests from the parent until it sends ``None``."""
    torch.set_num_threads(1)  # 2 ranks x 1 thread: the same 2-thread budget as the others
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=PEER_REPLY_TIMEOUT_S),
        )
        cut = shape.blocks // 2
        blocks = list(_model(shape))
        half = nn.Sequential(*(blocks[:cut] if rank == 0 else blocks[cut:]))
        x, y = _data(shape)
        schedules = {}
        for name, kind in zip(PEER_SCHEDULES, (ScheduleGPipe, Schedule1F1B)):
            part = copy.deepcopy(half)  # each schedule trains its own copy from the same start
            # A group per schedule: their point-to-point messages can never cross.
            stage = PipelineStage(part, rank, 2, torch.device("cpu"), group=dist.new_group([0, 1]))
            sched = kind(stage, shape.microbatches, loss_fn=_loss, scale_grads=False)
            opt = torch.optim.AdamW(part.parameters(), lr=LR, fused=True)
            schedules[name] = (sched, opt)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while (request := conn.recv()) is not None:
            name, steps = request
            sched, opt = schedules[name]
            first: float | None = None
            for i in range(steps):
                if rank == 0:
                    sched.step(x, return_outputs=False)
                else:
                    losses: list[torch.Tensor] = []
                    sched.step(target=y, losses=losses, return_outputs=False)
                    if i == 0:
                        first = torch.stack(losses).sum().item()
                opt.step()
                opt.zero_grad(set_to_none=True)
            conn.send(("ok", first))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class PeerPipeline:
    """The 2 gloo ranks, started once; ``runner(schedule)`` drives one schedule kind."""

    def __init__(self, shape: Shape) -> None:
        # Forked where the OS can (as DataLoader workers are), before the parent computes
        # anything or starts threads of its own, so the ranks need not import torch and
        # torch.distributed.pipelining again (seconds each on a busy machine); else spawned.
        fork = "fork" in mp.get_all_start_methods()
        ctx = mp.get_context("fork") if fork else mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="peer_pipeline_")
        store = str(Path(self._dir.name) / "store")
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_peer_rank, args=(rank, shape, store, child), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            self._replies()
        except BaseException:
            self.close()
            raise

    def _replies(self) -> list[object]:
        """Each rank's answer, in rank order. The first failure (or death) of either rank
        is raised at once -- the other rank may be stuck waiting for it -- never waited out."""
        answers: dict[int, object] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            ready = wait(list(pending.values()), timeout=PEER_REPLY_TIMEOUT_S)
            if not ready:
                raise RuntimeError(
                    f"peer ranks {sorted(pending)} sent nothing in {PEER_REPLY_TIMEOUT_S:.0f} s "
                    f"(exit codes {[self._procs[r].exitcode for r in sorted(pending)]})"
                )
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, value = conn.recv()
                except EOFError:
                    code = self._procs[rank].exitcode
                    raise RuntimeError(
                        f"peer rank {rank} exited (code {code}) without answering"
                    ) from None
                if status == "error":
                    raise RuntimeError(f"peer rank {rank} failed:\n{value}")
                answers[rank] = value
                del pending[rank]
        return [answers[rank] for rank in range(len(self._conns))]

    def runner(self, schedule: str) -> Runner:
        def run(steps: int) -> float:
            for conn in self._conns:
                conn.send((schedule, steps))
            last_rank_loss = self._replies()[1]
            assert isinstance(last_rank_loss, float)
            return last_rank_loss

        return run

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)  # a rank stuck on its failed peer does not read None
            if proc.is_alive():
                proc.terminate()
                proc.join()
        self._dir.cleanup()


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _check_losses(label: str, losses: dict[str, float]) -> None:
    """Print each variant's loss; stop the run if any differs from plain's."""
    print(f"{label} loss per variant (the sum of its per-microbatch mean losses):")
    ref = losses["plain"]
    for name, value in losses.items():
        print(f"  {name:<24}{value:.9f}")
    off = {n: v for n, v in losses.items() if not abs(v - ref) <= LOSS_RTOL * abs(ref)}
    if off:
        raise SystemExit(
            f"{label} losses differ from plain's {ref:.9f} by more than {LOSS_RTOL:g} "
            f"relative: {off}; the variants do not compute the same thing"
        )


def _ratio_line(label: str, ratios: list[float], target: float) -> str:
    med = statistics.median(ratios)
    lo, hi = _quartiles(ratios)
    verdict = "met" if med <= target else "NOT met"
    return f"target {label} <= {target:.2f}: {med:.2f} [{lo:.2f}..{hi:.2f}] per round, {verdict}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4, help="steps per variant and round")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: width 32, 4 blocks, "
        "batch 16, 2 rounds of 1 step (overrides those options)",
    )
    args = ap.parse_args()
    if args.quick:
        args.width, args.blocks, args.batch, args.rounds, args.steps = 32, 4, 16, 2, 1
    if args.blocks < 2:
        ap.error(f"--blocks must be >= 2 (one half per pipeline rank), got {args.blocks}")
    if args.microbatches < 2:
        ap.error(f"--microbatches must be >= 2 (1F1B needs one per rank), got {args.microbatches}")
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be >= 1")
    shape = Shape(args.width, args.blocks, args.batch, args.microbatches)

    peer = PeerPipeline(shape)  # started before this process starts threads of its own
    torch.set_num_threads(2)
    closers: list[Callable[[], None]] = [peer.close]
    try:
        rp1, close1, ran1 = _roundpipe(shape, "cpu:1")
        closers.append(close1)
        rp2, close2, ran2 = _roundpipe(shape, "cpu:2")
        closers.append(close2)
        rp2_alone, close2_alone, ran2_alone = _roundpipe(shape, "cpu:2", switch="0")
        closers.append(close2_alone)
        runners: dict[str, Runner] = {
            "plain": _plain(shape, checkpointed=False),
            "plain + checkpoint": _plain(shape, checkpointed=True),
            "peer GPipe": peer.runner("GPipe"),
            "peer 1F1B": peer.runner("1F1B"),
            "rp cpu:1": rp1,
            "rp cpu:2": rp2,
            "rp cpu:2 one at a time": rp2_alone,
        }
        # Step 0 doubles as the warm-up (allocations, the pipeline's shape exchange,
        # RoundPipe's first, dropped, timer measurement).
        _check_losses("step-0", {name: run(1) for name, run in runners.items()})
        step1: dict[str, float] = {}

        def timed(name: str) -> Callable[[], None]:
            def call() -> None:
                first = runners[name](args.steps)
                step1.setdefault(name, first)

            return call

        timings = interleave({name: timed(name) for name in runners}, rounds=args.rounds, warmup=0)
        ran = {"rp cpu:1": ran1(), "rp cpu:2": ran2(), "rp cpu:2 one at a time": ran2_alone()}
    finally:
        for close in reversed(closers):
            close()
    _check_losses("step-1", step1)

    per_step = {name: [s * 1000.0 / args.steps for s in t.seconds] for name, t in timings.items()}
    print(
        f"{shape.blocks} x (Linear({shape.width}) + GELU), batch {shape.batch}, "
        f"{shape.microbatches} microbatches, fused AdamW, 2 threads per variant (peer: 2 gloo "
        f"ranks x 1 thread); {args.steps} steps per variant, {args.rounds} interleaved rounds"
    )
    print(f"{'variant':<22}{'median ms':>10}{'p25..p75':>18}{'/ plain':>9}{'per-round spread':>20}")

    def per_round(name: str, base: str) -> list[float]:
        return [t / b for t, b in zip(per_step[name], per_step[base])]

    for name, ms in per_step.items():
        lo, hi = _quartiles(ms)
        ratios = per_round(name, "plain")
        rlo, rhi = _quartiles(ratios)
        print(
            f"{name:<22}{statistics.median(ms):>10.1f}{f'{lo:.1f}..{hi:.1f}':>18}"
            f"{statistics.median(ratios):>9.2f}{f'[{rlo:.2f}..{rhi:.2f}]':>20}"
        )
    print(_ratio_line("rp cpu:2 / peer 1F1B", per_round("rp cpu:2", "peer 1F1B"), 1.0))
    print(_ratio_line("rp cpu:2 / rp cpu:1", per_round("rp cpu:2", "rp cpu:1"), 1.05))
    alone = per_round("rp cpu:2 one at a time", "peer 1F1B")
    lo, hi = _quartiles(alone)
    print(
        f"rp cpu:2 one at a time / peer 1F1B: {statistics.median(alone):.2f} "
        f"[{lo:.2f}..{hi:.2f}] per round (ROUNDPIPE_CPU_CONCURRENT=0; not a target)"
    )
    for name, jobs in ran.items():
        print(f"{name} ran: {jobs}")


if __name__ == "__main__":
    main()
