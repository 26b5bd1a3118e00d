"""Device memory bound and engine overhead of RoundPipe on the CPU backend, side by side.

    python benchmarks/memory_and_overhead.py [--layers 16] [--width 512] [--steps 6]

One run trains the same nn.Sequential (a stack of MLP blocks) with plain
PyTorch and with RoundPipe on 1, 2 and 4 CPU workers, and prints, per
configuration:

- ``peak dev / model``: the most parameter bytes any one device held at once,
  as a share of the whole model — the point of RoundPipe: a device needs room
  for two stages (the running one and the prefetched one), not for the model;
- ``time / plain``: step time relative to plain PyTorch in the same run. On the
  CPU backend every "device" shares the same cores, so this measures the
  engine's bookkeeping (uploads are real copies, activations go through the
  host, compute is serialised); it is not the GPU speed-up.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
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


def time_plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def time_roundpipe(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, devices: int, stages: int
):
    rp = RoundPipe(model, devices=f"cpu:{devices}", optim_dtype=torch.float32)
    layers = rp.num_layers
    plan = ModelExecutePlan.uniform(layers, stages, "fused")
    cfg = RoundPipeRunConfig(num_microbatch=devices + 1, execute_plan=plan)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4, fused=True)
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            rp.forward_backward((x,), label=y, loss_fn=loss_fn, run_config=cfg)
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
            times.append(time.perf_counter() - t0)
        rp.synchronize()
        peak = max(w.ledger.peak.get("param", 0) for w in rp.pool.workers)
    finally:
        rp.close()
    return sorted(times)[len(times) // 2], peak


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    model = build(args.layers, args.width)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    plain = time_plain(copy.deepcopy(model), x, y, args.steps)
    print(
        f"model: {args.layers} blocks x width {args.width} = {model_bytes / 2**20:.1f} MiB of fp32 parameters"
    )
    print(f"{'config':<28}{'stages':>7}{'peak dev / model':>18}{'time / plain':>14}")
    print(f"{'plain PyTorch':<28}{'-':>7}{1.0:>18.2f}{1.0:>14.2f}")
    for devices in (1, 2, 4):
        stages = 2 * devices + 2
        t, peak = time_roundpipe(copy.deepcopy(model), x, y, args.steps, devices, stages)
        print(
            f"{f'RoundPipe, {devices} CPU worker(s)':<28}{stages:>7}{peak / model_bytes:>18.2f}{t / plain:>14.2f}"
        )


if __name__ == "__main__":
    main()
