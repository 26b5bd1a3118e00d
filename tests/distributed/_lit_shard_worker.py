"""One node of the Lightning sharded-host-state test: ``python _lit_shard_worker.py OUT_DIR``.

``Trainer(strategy=RoundPipeStrategy(shard_host_state=...), num_nodes=2,
accumulate_grad_batches=2, gradient_clip_val=...)`` with AdamW, this process being one
node: for an fp32 module (``sync``: its parameters are their own masters) and a bf16 one
with fp32 masters (``separate``: ``precision="bf16-true"``, the masters sharded too), both
``async_step=False``, and the bf16 one with ``async_step=True`` (``async``: one step
stale, the masters sharded too; ``overlapped``: the same with no hook reading the
gradients, so its iterations overlap), unsharded then sharded, fit 2 steps, save a checkpoint
(sharded: one shard per node), resume from it to 4 steps. Writes the weights after each fit to OUT_DIR.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from roundpipe_lightning import RoundPipeStrategy

WIDTH, BLOCKS, N = 8, 4, 24
GLOBAL_BATCH, ACCUM, STEPS, RESUMED_STEPS = 6, 2, 2, 4
CLIP = 0.05  # small enough that every step clips


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, WIDTH, generator=g), torch.randn(N, WIDTH, generator=g))


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
        )
        self._batch = 1

    def configure_sequential(self) -> nn.Module:
        return self.net

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).sum() / self._batch

    def training_step(self, batch, batch_idx):
        x, y = batch
        self._batch = x.shape[0]
        x = x.to(self.net[0][0].weight.dtype)  # (bf16-true: the module's dtype)
        loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)
        # issued non-blocking (overlapped iterations): the loss is a LazyLoss
        self.__dict__.setdefault("loss_kinds", []).append(type(loss).__name__)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)


class LitReadingGrads(Lit):
    """:class:`Lit` with a hook reading the gradients on the training thread (its
    iterations run blocking)."""

    def on_before_optimizer_step(self, optimizer) -> None:
        # what a user's hook reads on the module (grad-norm logging): reduced over the nodes
        if not hasattr(self, "first_grads"):
            self.first_grads = {
                n: p.grad.clone() for n, p in self.net.named_parameters() if p.grad is not None
            }


# overlapped: async, and no hook reads the gradients -- the iterations overlap, the
# reduction and the clipping run on the optimizer thread in front of each step
MODES = ("sync", "separate", "async", "overlapped")


def trainer(max_steps: int, num_nodes: int, shard: bool, mode: str) -> L.Trainer:
    return L.Trainer(
        strategy=RoundPipeStrategy(
            async_step=mode in ("async", "overlapped"),
            num_microbatch=3,
            process_group_timeout=20,
            shard_host_state=shard,
        ),
        precision="32-true" if mode == "sync" else "bf16-true",
        accelerator="cpu",
        devices=2,
        num_nodes=num_nodes,
        max_steps=max_steps,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def params(model: Lit) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}


def masters(tr: L.Trainer) -> dict[str, torch.Tensor]:
    """The fp32 masters this process holds values for (its share, sharded), by name."""
    rp = tr.strategy.roundpipe
    return {
        n: m.detach().clone()
        for n, m in rp.optim_named_parameters()
        if id(m) not in rp.masters.released
    }


def run(loader: DataLoader, num_nodes: int, ckpt: Path, shard: bool, mode: str) -> dict:
    module = Lit if mode == "overlapped" else LitReadingGrads
    model = module()
    tr = trainer(STEPS, num_nodes, shard, mode)
    tr.fit(model, loader)
    first, first_masters = params(model), masters(tr)
    first_grads = getattr(model, "first_grads", None)
    tr.save_checkpoint(ckpt)
    resumed = module()
    tr = trainer(RESUMED_STEPS, num_nodes, shard, mode)
    tr.fit(resumed, loader, ckpt_path=ckpt)
    out = {
        "loss_kinds": [model.loss_kinds, resumed.loss_kinds],
        "first": first,
        "first_grads": first_grads,
        "resumed": params(resumed),
        "first_masters": first_masters,
        "resumed_masters": masters(tr),
    }
    # loaded and not trained further (max_steps reached): the masters as loaded
    tr = trainer(STEPS, num_nodes, shard, mode)
    tr.fit(module(), loader, ckpt_path=ckpt)
    out["loaded_masters"] = masters(tr)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["NODE_RANK"])
    ds = dataset()
    loader = DataLoader(
        ds,
        batch_size=GLOBAL_BATCH // 2,
        sampler=DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=False),
    )
    for mode in MODES:
        for shard in (False, True):
            name = f"{mode}_{'sharded' if shard else 'plain'}"
            res = run(loader, 2, out / f"{name}.ckpt", shard, mode)
            torch.save(res, out / f"{name}_rank{rank}.pt")


if __name__ == "__main__":
    main()
