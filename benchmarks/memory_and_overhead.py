"""Device memory bound and engine overhead of RoundPipe on the CPU backend, side by side.

    python benchmarks/memory_and_overhead.py [--layers 16] [--width 512] [--rounds 12]

One run trains the same nn.Sequential (a stack of MLP blocks) with plain
PyTorch and with RoundPipe on 1, 2 and 4 CPU workers, and prints, per
configuration:

- ``peak dev / model``: the most parameter bytes any one device held at once,
  as a share of the whole model — the point of RoundPipe: a device needs room
  for two stages (the running one and the prefetched one), not for the model;
- ``time / plain``: median step time relative to plain PyTorch, the variants
  interleaved round by round in the same run (with the spread). On the
  CPU backend every "device" shares the same cores, so this measures the
  engine's bookkeeping (uploads are real copies, activations go through the
  host, compute is serialised); it is not the GPU speed-up.
"""

from __future__ import annotations

import argparse
import copy

import torch
from _interleave import interleave
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


def build(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        for _ in range(layers)
    ]
    return nn.Sequential(*blocks)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def roundpipe_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, devices: int, stages: int):
    rp = RoundPipe(model, devices=f"cpu:{devices}", optim_dtype=torch.float32)
    plan = ModelExecutePlan.uniform(rp.num_layers, stages, "fused")
    cfg = RoundPipeRunConfig(num_microbatch=devices + 1, execute_plan=plan)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4, fused=True)

    def step() -> None:
        rp.forward_backward((x,), label=y, loss_fn=loss_fn, run_config=cfg)
        # synchronous step: a timed round must not leave work running into the next variant's
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)

    return rp, step


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    model = build(args.layers, args.width)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    variants = {"plain PyTorch": plain_step(copy.deepcopy(model), x, y)}
    pipes, stages_of = {}, {}
    for devices in (1, 2, 4):
        name = f"RoundPipe, {devices} CPU worker(s)"
        stages_of[name] = 2 * devices + 2
        pipes[name], variants[name] = roundpipe_step(
            copy.deepcopy(model), x, y, devices, stages_of[name]
        )
    try:
        timings = interleave(variants, rounds=args.rounds)
        peaks = {
            name: max(w.ledger.peak.get("param", 0) for w in rp.pool.workers)
            for name, rp in pipes.items()
        }
    finally:
        for rp in pipes.values():
            rp.close()
    print(
        f"model: {args.layers} blocks x width {args.width} = {model_bytes / 2**20:.1f} MiB of fp32 "
        f"parameters; {args.rounds} interleaved rounds, median and interquartile spread"
    )
    plain = timings["plain PyTorch"]
    print(
        f"{'config':<28}{'stages':>7}{'peak dev / model':>18}{'time / plain':>14}{'p25..p75 ms':>16}"
    )
    for name, t in timings.items():
        lo, hi = t.spread_ms
        stages = str(stages_of.get(name, "-"))
        peak = peaks[name] / model_bytes if name in peaks else 1.0
        print(
            f"{name:<28}{stages:>7}{peak:>18.2f}{t.median_ms / plain.median_ms:>14.2f}"
            f"{f'{lo:.1f}..{hi:.1f}':>16}"
        )


if __name__ == "__main__":
    main()
