"""Train an nn.Sequential with the RoundPipe core directly (no Lightning).

    python examples/core_train.py [--devices cpu:2] [--steps 30] [--trace last.json]

A small regression MLP learns y = sin(W x); the loss falls, and the script
checks at the end that the module's own parameters hold the trained weights.
``--trace PATH`` saves the last iteration's measured timeline (``last_trace()``:
a row per device and the optimizer step) as JSON for https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from roundpipe_core import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe_core.running.trace import write_trace


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--devices", default=None, help="None (all GPUs, else 2 CPU workers), an int, or 'cpu:N'"
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--trace", default=None, help="write the last iteration's trace here (JSON)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    true_w = torch.randn(16, 8) * 0.25
    net = nn.Sequential(
        nn.Linear(16, 64),
        *[nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU()) for _ in range(6)],
        nn.Linear(64, 8),
    )
    model = RoundPipe(
        net,
        optim_dtype=torch.float32,
        devices=args.devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches),
    )
    with OptimizerCtx():  # model.parameters() are the fp32 master copies here
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).sum() / 64  # summed over microbatches: the batch mean

    print(f"{model!r}; plan: {model.default_plan('fused')}")
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 16)
        loss = model.forward_backward(input_args=(x,), label=torch.sin(x @ true_w), loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()))  # async, one step stale
        if step == 1 or step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    model.synchronize()
    if args.trace:
        # after synchronize(): the last step has run, so its span is in the trace
        print(f"trace of the last iteration: {write_trace(args.trace, model.last_trace())}")
    for p, m in zip(net.parameters(), model.optim_parameters()):
        assert torch.equal(p.detach(), m.detach())
    model.close()
    print("done: the nn.Sequential holds the trained weights")


if __name__ == "__main__":
    main()
