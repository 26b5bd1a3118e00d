"""One node of the Lightning resume test: ``python _lit_worker.py OUT_DIR``.

``Trainer(strategy=RoundPipeStrategy(async_step=True), accelerator="cpu", devices=2,
num_nodes=2, accumulate_grad_batches=2)``, this process being one node (``NODE_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK=0``): fit, save a checkpoint
(rank 0 writes it), then -- in the same process, a second ``Trainer.fit`` -- resume from
that file on every rank. Writes the parameters after each fit and the logged
(``sync_dist=True``) loss to OUT_DIR. Then one more fit, of a module no hook of which
reads the gradients (its iterations overlap); writes its parameters too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from roundpipe_lightning import RoundPipeStrategy

# The strategy's full host-memory table is a DEBUG record (its INFO line is a summary):
# the test reads the table's collective-buffers row from this log.
logging.getLogger("lightning.pytorch").setLevel(logging.DEBUG)

IN_DIM, OUT_DIM, N = 5, 3, 24
GLOBAL_BATCH, ACCUM, STEPS, RESUMED_STEPS = 6, 2, 2, 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, IN_DIM, generator=g), torch.randn(N, OUT_DIM, generator=g))


class Lit(L.LightningModule):
    """Mean squared error over this process's batch, as a DDP user writes it. No hook
    reads the gradients, so with ``async_step=True`` its iterations overlap."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(IN_DIM, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, OUT_DIM)
        )

    def configure_sequential(self) -> nn.Module:
        return self.net

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # a batch mean, as in plain Lightning (loss_reduction="mean" weights the microbatches)
        return ((out - y) ** 2).sum(-1).mean()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)
        # issued non-blocking (overlapped iterations): the loss is a LazyLoss
        self.lazy_losses = getattr(self, "lazy_losses", 0) + (type(loss).__name__ == "LazyLoss")
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # SGD: Adam would hide a wrong gradient scale (a missing division by the world size)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class LitReadingGrads(Lit):
    """:class:`Lit` with a hook that reads the gradients on the training thread (so its
    iterations run blocking and the reduction overlaps the backward)."""

    def on_before_optimizer_step(self, optimizer) -> None:
        # what a user's hook reads on the module (grad-norm logging): the reduced gradients
        if not hasattr(self, "first_grads"):
            self.first_grads = {n: p.grad.clone() for n, p in self.net.named_parameters()}


def trainer(max_steps: int, num_nodes: int) -> L.Trainer:
    return L.Trainer(
        strategy=RoundPipeStrategy(async_step=True, num_microbatch=3, process_group_timeout=20),
        accelerator="cpu",
        devices=2,
        num_nodes=num_nodes,
        max_steps=max_steps,
        accumulate_grad_batches=ACCUM,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def run_overlapped(loader: DataLoader, num_nodes: int) -> dict:
    """Fit :class:`Lit` (overlapped iterations): the parameters, how many losses were lazy."""
    model = Lit()
    trainer(RESUMED_STEPS, num_nodes).fit(model, loader)
    params = {k: v.detach().clone() for k, v in model.net.state_dict().items()}
    return {"params": params, "lazy_losses": model.lazy_losses}


def run(loader: DataLoader, num_nodes: int, ckpt: Path) -> dict:
    """Fit, save ``ckpt``, resume from it: parameters after each fit, the logged loss."""
    model = LitReadingGrads()
    tr = trainer(STEPS, num_nodes)
    tr.fit(model, loader)
    first = {k: v.detach().clone() for k, v in model.net.state_dict().items()}
    first_grads = model.first_grads
    tr.save_checkpoint(ckpt)  # rank 0 writes
    loss = float(tr.callback_metrics["train_loss"])
    resumed = LitReadingGrads()
    tr2 = trainer(RESUMED_STEPS, num_nodes)
    tr2.fit(resumed, loader, ckpt_path=ckpt)
    return {
        "first": first,
        "first_grads": first_grads,
        "resumed": {k: v.detach().clone() for k, v in resumed.net.state_dict().items()},
        "loss": loss,
        "step": tr2.global_step,
        "world": tr.world_size,
        "rank": tr.global_rank,
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["NODE_RANK"])
    ds = dataset()
    # each global batch of GLOBAL_BATCH samples splits in two halves, in order
    loader = DataLoader(
        ds,
        batch_size=GLOBAL_BATCH // 2,
        sampler=DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=False),
    )
    res = run(loader, 2, out / "model.ckpt")
    torch.save(run_overlapped(loader, 2), out / f"overlapped_rank{rank}.pt")
    torch.save(
        {k: res[k] for k in ("first", "first_grads", "resumed")}, out / f"params_rank{rank}.pt"
    )
    (out / f"info_rank{rank}.json").write_text(
        json.dumps({k: res[k] for k in ("loss", "step", "world", "rank")})
    )


if __name__ == "__main__":
    main()
