"""Step time of RoundPipe on one CPU device against plain PyTorch, side by side.

    python benchmarks/cpu_overhead.py [--width 1024] [--batch 256] [--steps 8]

One run, one process, the same 8-block MLP stack (sized for steps of tens of
milliseconds on 2 cores) and the same data, trained with AdamW:

- ``plain``: plain PyTorch, forward + backward;
- ``checkpoint``: plain PyTorch with per-layer ``torch.utils.checkpoint``
  (the same recompute work RoundPipe does);
- ``roundpipe``: RoundPipe on 1 CPU worker, ``is_async=False``, its default
  plan (fused last stage + recompute) and default microbatches (devices + 1 = 2);
- ``roundpipe M=1``: the same with one microbatch (full-size matrix products,
  as the baselines have: isolates the engine's own cost from the smaller GEMMs).

The configurations are interleaved step by step (A, B, C, A, B, C, ...) after a
warm-up, and the median step time of each is reported with its ratio to the
baselines, so machine noise hits all three alike. RoundPipe's extra work on
the CPU backend: the stage "upload" (a real copy of the weights), activation
copies through the host, gradient download + accumulation into the fp32
masters and the master -> model copy after the step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe_core import RoundPipe, RoundPipeRunConfig


def build(width: int, layers: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    args = ap.parse_args()

    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    plain, ckpt, rp_model = build(args.width), build(args.width), build(args.width)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    opt_ckpt = torch.optim.AdamW(ckpt.parameters(), lr=1e-4, fused=True)
    rp = RoundPipe(
        rp_model,
        devices="cpu:1",
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches),
    )
    opt_rp = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4, fused=True)
    rp1 = RoundPipe(
        build(args.width),
        devices="cpu:1",
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=1),
    )
    opt_rp1 = torch.optim.AdamW(rp1.optim_parameters(), lr=1e-4, fused=True)

    def step_plain() -> None:
        loss_fn(plain(x), y).backward()
        opt_plain.step()
        opt_plain.zero_grad()

    def step_ckpt() -> None:
        h = x
        for layer in ckpt:
            h = checkpoint(layer, h, use_reentrant=False)
        loss_fn(h, y).backward()
        opt_ckpt.step()
        opt_ckpt.zero_grad()

    def step_rp() -> None:
        rp.forward_backward((x,), label=y, loss_fn=loss_fn)
        rp.step(lambda: (opt_rp.step(), opt_rp.zero_grad()), is_async=False)

    def step_rp1() -> None:
        rp1.forward_backward((x,), label=y, loss_fn=loss_fn)
        rp1.step(lambda: (opt_rp1.step(), opt_rp1.zero_grad()), is_async=False)

    runs = {
        "plain": step_plain,
        "checkpoint": step_ckpt,
        "roundpipe": step_rp,
        "roundpipe M=1": step_rp1,
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(2):  # warm-up
        for fn in runs.values():
            fn()
    for _ in range(args.steps):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rp.close()
    rp1.close()
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(
        f"8 x Linear({args.width}) + GELU, batch {args.batch}, {args.steps} interleaved steps, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'config':<15}{'median ms':>11}{'/ plain':>9}{'/ checkpoint':>14}")
    for k in runs:
        print(
            f"{k:<15}{med[k]:>11.1f}{med[k] / med['plain']:>9.2f}{med[k] / med['checkpoint']:>14.2f}"
        )


if __name__ == "__main__":
    main()
