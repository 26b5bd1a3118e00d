"""One node of the Fabric data-parallel test: ``python _fabric_shard_worker.py OUT_DIR``.

``Fabric(strategy=RoundPipeFabricStrategy(shard_host_state=...), num_nodes=2)`` with
AdamW, ``async_step=False``, two backward calls per step and ``fabric.clip_gradients``
(small enough that every step clips), this process being one node; unsharded, then
sharded: train ``STEPS`` steps, ``fabric.save``, train ``MORE`` steps (the run that
was never interrupted); then a fresh run from another starting point ``fabric.load``s
the file and trains the same ``MORE`` steps. Writes the weights of each phase and the
optimizer-state bytes to ``OUT_DIR/{plain,sharded}_rank{R}.pt``; the same with a
bf16 module (cast by hand, as the strategy asks; fp32 masters, sharded too) to ``{plain,sharded}_bf16_rank{R}.pt``,
with the bytes of the masters each node holds values for.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from roundpipe_core.distributed import state_bytes
from roundpipe_lightning import RoundPipeFabricStrategy

WIDTH, BLOCKS, N = 8, 4, 60
NODE_BATCH, ACCUM, STEPS, MORE = 3, 2, 3, 2
CLIP = 0.05
# (module dtype, file suffix, async_step): fp32, bf16 with fp32 masters (sharded too),
# and bf16 stepping asynchronously (the masters sharded too, one step stale)
VARIANTS = (
    (torch.float32, "", False),
    (torch.bfloat16, "_bf16", False),
    (torch.bfloat16, "_bf16_async", True),
)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, WIDTH, generator=g), torch.randn(N, WIDTH, generator=g))


def build_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    )


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def fabric_of(num_nodes: int, shard: bool, is_async: bool = False) -> Fabric:
    strategy = RoundPipeFabricStrategy(
        async_step=is_async, num_microbatch=3, process_group_timeout=20, shard_host_state=shard
    )
    return Fabric(strategy=strategy, accelerator="cpu", devices=2, num_nodes=num_nodes)


def master_bytes(model: Any) -> int:
    """Bytes the separate masters' storage holds (a released one: a few bytes)."""
    return sum(m.untyped_storage().nbytes() for _, _, m in model.roundpipe.masters.copies)


def train(fabric: Fabric, model: Any, opt: Any, batches: list, steps: int) -> None:
    """``steps`` optimizer steps of ``ACCUM`` batches each, clipped by the global norm."""
    for s in range(steps):
        for x, y in batches[s * ACCUM : (s + 1) * ACCUM]:
            x = x.to(next(model.parameters()).dtype)  # (a bf16 module: its dtype)
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        fabric.clip_gradients(model, opt, max_norm=CLIP)
        opt.step()
        opt.zero_grad()


def weights(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def run(
    num_nodes: int,
    shard: bool,
    ckpt: Path,
    batch_size: int,
    dtype: torch.dtype = torch.float32,
    is_async: bool = False,
) -> dict[str, Any]:
    fabric = fabric_of(num_nodes, shard, is_async)
    net = build_net().to(dtype)
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.1))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=batch_size, shuffle=False))
    batches = list(loader)
    train(fabric, model, opt, batches, STEPS)
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": STEPS})
    model.synchronize()
    first = weights(net)
    opt_bytes = state_bytes(opt.optimizer)
    masters = master_bytes(model)
    train(fabric, model, opt, batches[STEPS * ACCUM :], MORE)
    model.synchronize()
    continued = weights(net)
    fabric.strategy.teardown()

    resumed = resume(num_nodes, shard, ckpt, batch_size, dtype, is_async)
    return {
        "first": first,
        "continued": continued,
        "resumed": resumed,
        "opt_bytes": opt_bytes,
        "master_bytes": masters,
    }


def resume(
    num_nodes: int,
    shard: bool,
    ckpt: Path,
    batch_size: int,
    dtype: torch.dtype = torch.float32,
    is_async: bool = False,
) -> dict[str, torch.Tensor]:
    """A fresh run from another starting point: everything must come from ``ckpt``."""
    fabric = fabric_of(num_nodes, shard, is_async)
    net = build_net().to(dtype)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.5))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=batch_size, shuffle=False))
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(ckpt, state)
    assert state["step"] == STEPS, state["step"]
    train(fabric, model, opt, list(loader)[STEPS * ACCUM :], MORE)
    model.synchronize()
    out = weights(net)
    fabric.strategy.teardown()
    return out


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["NODE_RANK"])
    for dtype, suffix, is_async in VARIANTS:
        for shard in (False, True):
            name = ("sharded" if shard else "plain") + suffix
            res = run(2, shard, out / f"{name}.ckpt", NODE_BATCH, dtype, is_async)
            torch.save(res, out / f"{name}_rank{rank}.pt")


if __name__ == "__main__":
    main()
