"""What a user gets on CPU workers with RoundPipe's defaults, against plain PyTorch.

    python benchmarks/cpu_defaults.py [--rounds 7] [--steps 4] [--width 1024] [--blocks 16]

A stack of ``--blocks`` x (Linear(width) + GELU), batch 256 in 4 microbatches, fused
AdamW, torch threads 2 (the machine's cores). One training step per variant, timed
over ``--steps`` steps after a warm-up step; the variants interleave round by round:

* ``plain``: PyTorch, the 4 microbatches' losses summed and backpropagated, then
  ``opt.step()`` -- the same arithmetic RoundPipe does;
* ``rp cpu:1`` / ``rp cpu:2``: ``RoundPipe(devices=...)`` with its default plan
  (CPU workers compute one at a time: the fewest stages memory allows) and a
  synchronous step over ``optim_parameters()``;
* ``rp cpu:2 pipelined``: the same with the plan the planner makes for devices
  that overlap (``ModelExecutePlan.auto(..., concurrent=True)``), what the default
  was before the planner knew that CPU workers do not.

Printed: median ms per step and [p25..p75] over rounds, and each variant's ratio to
``plain`` (per round, median and spread).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

BATCH, MICROBATCHES = 256, 4


def _model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)]
    )


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _plain(width: int, blocks: int) -> tuple[Callable[[], None], Callable[[], None]]:
    model = _model(width, blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(BATCH, width), torch.randn(BATCH, width)

    def step() -> None:
        loss = sum(_loss(model(a), b) for a, b in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)))
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def _roundpipe(
    width: int, blocks: int, devices: str, pipelined: bool
) -> tuple[Callable[[], None], Callable[[], None]]:
    rp = RoundPipe(
        _model(width, blocks),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=MICROBATCHES),
    )
    if pipelined:
        plan = ModelExecutePlan.auto("fused", rp, num_microbatch=MICROBATCHES, concurrent=True)
        assert isinstance(plan, ModelExecutePlan)
        rp.set_plan("fused", plan)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(BATCH, width), torch.randn(BATCH, width)

    def update() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step() -> None:
        rp.forward_backward((x,), label=y, loss_fn=_loss)
        rp.step(update, is_async=False)

    return step, rp.close


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(2)
    variants = {
        "plain": lambda: _plain(args.width, args.blocks),
        "rp cpu:1": lambda: _roundpipe(args.width, args.blocks, "cpu:1", False),
        "rp cpu:2": lambda: _roundpipe(args.width, args.blocks, "cpu:2", False),
        "rp cpu:2 pipelined": lambda: _roundpipe(args.width, args.blocks, "cpu:2", True),
    }
    built = {name: make() for name, make in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for step, _ in built.values():
            step()  # warm-up: allocations, the timer's first (dropped) measurement
        for _ in range(args.rounds):
            for name, (step, _) in built.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[name].append((time.perf_counter() - t0) * 1000.0 / args.steps)
    finally:
        for _, close in built.values():
            close()
    print(
        f"{args.blocks} x (Linear({args.width}) + GELU), batch {BATCH}, {MICROBATCHES} "
        f"microbatches, fused AdamW, torch threads 2; {args.steps} steps per variant, "
        f"{args.rounds} interleaved rounds (ms per step)"
    )
    print(f"{'variant':<22}{'median ms':>10}{'p25..p75':>18}{'/ plain':>9}{'per-round spread':>22}")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        ratios = [t / p for t, p in zip(ts, times["plain"])]
        rq = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(
            f"{name:<22}{statistics.median(ts):>10.1f}{f'{q[0]:.1f}..{q[2]:.1f}':>18}"
            f"{statistics.median(ratios):>9.2f}{f'[{rq[0]:.2f}..{rq[2]:.2f}]':>22}"
        )


if __name__ == "__main__":
    main()
