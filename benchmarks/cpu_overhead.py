"""Step time of RoundPipe on one CPU worker against plain PyTorch, like for like.

    python benchmarks/cpu_overhead.py [--width 1024] [--batch 256] [--layers 8] [--rounds 15]

One process, the same MLP stack and data, AdamW(fused=True) everywhere. Two pairs
that do the same arithmetic:

- ``plain`` vs ``roundpipe 1 stage``: no recompute on either side (RoundPipe runs
  one fused stage: forward, loss and backward of all layers in one job);
- ``checkpoint`` vs ``roundpipe recompute``: every layer but the last is
  recomputed on both sides (plain PyTorch with ``torch.utils.checkpoint`` on those
  layers; RoundPipe with one stage per layer, so the fused last stage is the only
  one not recomputed).

Both RoundPipe variants use ``--microbatches`` (default 1: the same matrix sizes as
the baselines, so the ratio isolates the engine's own cost: stage "uploads" are
real weight copies on the CPU backend, activations go through the host, gradients
are downloaded into the fp32 masters and the masters are copied back after the
step). Variants are interleaved round by round; the table gives the median, the
interquartile spread and the ratio of medians.
"""

from __future__ import annotations

import argparse

import torch
from _interleave import format_table, interleave
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def roundpipe_step(width: int, layers: int, stages: int, microbatches: int, x, y):
    rp = RoundPipe(
        build(width, layers),
        devices="cpu:1",
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=microbatches,
            execute_plan=ModelExecutePlan.uniform(layers, stages, "fused"),
        ),
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4, fused=True)

    def step() -> None:
        rp.forward_backward((x,), label=y, loss_fn=loss_fn)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)

    return rp, step


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--microbatches", type=int, default=1)
    args = ap.parse_args()

    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    plain, ckpt = build(args.width, args.layers), build(args.width, args.layers)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    opt_ckpt = torch.optim.AdamW(ckpt.parameters(), lr=1e-4, fused=True)

    def step_plain() -> None:
        loss_fn(plain(x), y).backward()
        opt_plain.step()
        opt_plain.zero_grad()

    def step_ckpt() -> None:
        h = x
        for layer in ckpt[:-1]:  # the last layer is the one RoundPipe's fused stage keeps
            h = checkpoint(layer, h, use_reentrant=False)
        loss_fn(ckpt[-1](h), y).backward()
        opt_ckpt.step()
        opt_ckpt.zero_grad()

    rp1, step_rp1 = roundpipe_step(args.width, args.layers, 1, args.microbatches, x, y)
    rpr, step_rpr = roundpipe_step(args.width, args.layers, args.layers, args.microbatches, x, y)
    try:
        timings = interleave(
            {
                "plain": step_plain,
                "roundpipe 1 stage": step_rp1,
                "checkpoint": step_ckpt,
                "roundpipe recompute": step_rpr,
            },
            rounds=args.rounds,
        )
    finally:
        rp1.close()
        rpr.close()
    print(
        f"{args.layers} x (Linear({args.width}) + GELU), batch {args.batch}, "
        f"{args.microbatches} microbatch(es), {args.rounds} interleaved rounds, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(format_table(timings, ["plain", "checkpoint"]))
    print(
        "like for like: 'roundpipe 1 stage' / plain and 'roundpipe recompute' / checkpoint "
        "(the other ratios mix recompute and no recompute)"
    )


if __name__ == "__main__":
    main()
