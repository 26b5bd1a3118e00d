"""One "node" of the multi-process RoundPipeStrategy test: Trainer(num_nodes=2), launched
through the MASTER_ADDR / MASTER_PORT / WORLD_SIZE / NODE_RANK / LOCAL_RANK environment.

Usage: python _strategy_worker.py OUT_DIR STEPS [crash_at_step]
Writes OUT_DIR/params_rank{R}.pt (the trained parameters) and, on rank 0, the checkpoint.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GLOBAL_BATCH, build_model, make_data, make_optimizer  # noqa: E402

from roundpipe_lightning import RoundPipeStrategy  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, crash_at: int | None) -> None:
        super().__init__()
        self.net = build_model(0)
        self.crash_at = crash_at

    def configure_sequential(self):
        return self.net

    def training_step(self, batch, batch_idx):
        if self.crash_at is not None and batch_idx == self.crash_at and self.global_rank == 1:
            raise RuntimeError("rank 1 crashed on purpose")
        x, y = batch
        # a mean over this rank's share of the global batch (loss_reduction="mean" weights
        # the microbatches); the strategy averages the ranks
        loss = self.roundpipe.forward_backward(
            (x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum(-1).mean()
        )
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    crash_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    data = make_data(steps, 1)
    xs = torch.cat([w[0][0] for w in data])
    ys = torch.cat([w[0][1] for w in data])
    # each global batch of GLOBAL_BATCH samples: the distributed sampler gives each rank
    # half of it. Lightning would insert one itself (the strategy is distributed), but a
    # shuffling one; this one keeps the order so the run compares with the reference.
    ds = TensorDataset(xs, ys)
    sampler = DistributedSampler(
        ds, num_replicas=2, rank=int(os.environ["NODE_RANK"]), shuffle=False
    )
    loader = DataLoader(ds, batch_size=GLOBAL_BATCH // 2, sampler=sampler)
    model = Net(crash_at)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatch=3, async_step=False, process_group_timeout=15),
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    rank = trainer.global_rank
    assert trainer._accelerator_connector.is_distributed  # Lightning distributes plain samplers
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": rank}
    torch.save(
        {n: p.detach().clone() for n, p in model.net.named_parameters()},
        out / f"params_rank{rank}.pt",
    )
    trainer.save_checkpoint(out / "final.ckpt")  # written by rank 0 only
    print(f"rank {rank} done, world {trainer.world_size}", flush=True)


if __name__ == "__main__":
    main()
