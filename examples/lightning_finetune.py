"""Fine-tune a small byte-level transformer LM with Lightning and RoundPipe.

The network is an ``nn.Sequential`` -- embedding, decoder blocks, norm + head --
returned by ``configure_sequential()``; ``RoundPipeStrategy`` pipelines it over
the Trainer's devices (CPU workers here, GPUs with ``--accelerator gpu``). The
text is ``examples/data/tiny_corpus.txt``, shipped with the repository and
read as bytes, so nothing is downloaded.

Run (about a minute on 2 CPU cores)::

    python examples/lightning_finetune.py
    tensorboard --logdir runs/lightning_finetune      # losses, LR, RoundPipe stage times

Useful flags: ``--layout "fwd=2,2 bwd=1,1,1,1,1,1"`` fixes the stage plan,
``--auto-replan`` re-plans from measured layer times, ``--precision bf16-true``
trains bf16 weights with fp32 masters, ``--resume PATH`` continues from a
checkpoint, ``--init-from PATH`` starts a new run (fine-tune) from a checkpoint's
weights, ``--strategy plain`` runs the same module on Lightning's default
strategy for comparison, ``--trace DIR`` writes each logged step's measured and
simulated timeline as Perfetto-loadable JSON (TensorBoard's Images tab shows the
same as the picture ``roundpipe/timeline``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from roundpipe_lightning import AutoReplan, RoundPipeStrategy, StageTimeLogger

HERE = Path(__file__).resolve().parent
DEFAULT_CORPUS = HERE / "data" / "tiny_corpus.txt"
VOCAB = 256  # bytes


# ----------------------------------------------------------------------------- model
class Embed(nn.Module):
    """Layer 0: byte ids (B, T) -> hidden states (B, T, D), token + learned position embeddings."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # positions on the input's device: the layer may run on any device of the pool
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(pos)


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention + MLP, hidden states in and out."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = (
            self.qkv(self.ln1(h))
            .view(b, t, 3, self.n_heads, d // self.n_heads)
            .permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        h = h + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return h + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(h)))))


class Head(nn.Module):
    """Last layer: final norm + projection to byte logits."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens, as in plain Lightning. Under RoundPipeStrategy's
    ``loss_reduction="mean"`` each microbatch's mean is weighted by its share of the batch
    rows; every row holds ``seq_len`` tokens, so that is exactly the batch's token mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class ByteLM(L.LightningModule):
    """A byte-level causal LM whose network is an ``nn.Sequential`` for RoundPipe.

    Args:
        d_model: hidden size.
        n_layers: decoder blocks.
        n_heads: attention heads.
        seq_len: context length (bytes).
        dropout: dropout in the blocks (replayed exactly in RoundPipe's recompute).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps, then cosine decay to 10% at ``max_steps``.
    """

    def __init__(
        self,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            Embed(d_model, seq_len),
            *[DecoderBlock(d_model, n_heads, dropout) for _ in range(n_layers)],
            Head(d_model),
        )

    def configure_sequential(self) -> nn.Sequential:
        return self.net

    def _pipelined(self) -> bool:
        return getattr(self, "roundpipe", None) is not None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self._pipelined():
            # forward, loss and backward in one pipelined pass; the loss comes back detached
            # and, under RoundPipeStrategy(async_step=True), lazily: the next iteration
            # starts before it is known. prog_bar=True below reads it at the end of each
            # batch (waiting for that iteration); logger-only values are read when logged.
            loss = self.roundpipe.forward_backward(
                input_args=(x,), label=y, loss_fn=token_cross_entropy
            )
        else:
            loss = token_cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_bpb", loss / math.log(2))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.roundpipe(x) if self._pipelined() else self.net(x)
        loss = token_cross_entropy(logits, y)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_bpb", loss / math.log(2))

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and ".pos." not in n]
        no_decay = [
            p for n, p in self.named_parameters() if not (p.dim() >= 2 and ".pos." not in n)
        ]
        # left without fused=: RoundPipeStrategy(fuse_optimizer=True), the default, runs
        # it on torch's fused CPU kernel (the step is host time that each iteration pays)
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        total = max(1, self.trainer.max_steps if self.trainer.max_steps > 0 else 1000)
        warm = max(1, self.hparams.warmup_steps)

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @torch.no_grad()
    def generate(
        self, prompt: str, num_bytes: int = 200, temperature: float = 0.8, top_k: int = 20
    ) -> str:
        """Sample a continuation with the plain module (its weights are current after fit)."""
        was_training = self.training
        self.eval()
        ids = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long)
        g = torch.Generator().manual_seed(0)
        for _ in range(num_bytes):
            logits = self.net(ids[:, -self.hparams.seq_len :])[0, -1].float() / temperature
            top = torch.topk(logits, top_k)
            probs = torch.softmax(top.values, dim=-1)
            nxt = top.indices[torch.multinomial(probs, 1, generator=g)]
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        self.train(was_training)
        return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------ data
class ByteWindows(Dataset):
    """Windows of ``seq_len + 1`` bytes at a fixed stride: (input, next-byte targets)."""

    def __init__(self, data: torch.Tensor, seq_len: int, stride: int) -> None:
        if len(data) <= seq_len + 1:
            raise ValueError(
                f"the text has {len(data)} bytes, fewer than seq_len + 2 = {seq_len + 2}"
            )
        self.data, self.seq_len = data, seq_len
        self.starts = list(range(0, len(data) - seq_len - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        chunk = self.data[s : s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class ByteCorpus(L.LightningDataModule):
    """A text file as bytes; the last ``val_fraction`` is the validation split.

    Args:
        path: the text file (default: the corpus shipped in ``examples/data``).
        seq_len: context length.
        batch_size: sequences per batch.
        val_fraction: share of the bytes held out for validation.
    """

    def __init__(
        self,
        path: str = str(DEFAULT_CORPUS),
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__()
        self.path, self.seq_len, self.batch_size, self.val_fraction = (
            path,
            seq_len,
            batch_size,
            val_fraction,
        )

    def setup(self, stage: str | None = None) -> None:
        raw = torch.frombuffer(bytearray(Path(self.path).read_bytes()), dtype=torch.uint8).long()
        cut = int(len(raw) * (1 - self.val_fraction))
        self.train_set = ByteWindows(raw[:cut], self.seq_len, stride=self.seq_len // 2)
        self.val_set = ByteWindows(raw[cut:], self.seq_len, stride=self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


# ------------------------------------------------------------------------------- run
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    p.add_argument(
        "--out-dir", default="runs/lightning_finetune", help="TensorBoard logs and checkpoints"
    )
    p.add_argument("--strategy", choices=["roundpipe", "plain"], default="roundpipe")
    p.add_argument("--accelerator", default="cpu", help="cpu (CPU workers) or gpu")
    p.add_argument("--devices", type=int, default=2, help="CPU workers or GPUs in this process")
    p.add_argument(
        "--num-microbatch",
        type=int,
        default=None,
        help=(
            "microbatches per call (default: the engine's: devices + 1 on GPUs; on CPU "
            "workers one per worker, 1 for a model with buffers)"
        ),
    )
    p.add_argument(
        "--layout", default=None, help='stage plan, e.g. "fwd=2,2 bwd=1,1,1,1,1,1" or "auto"'
    )
    p.add_argument("--auto-replan", action="store_true", help="re-plan from measured layer times")
    step = p.add_mutually_exclusive_group()
    step.add_argument(
        "--sync-step",
        dest="async_step",
        action="store_false",
        help="synchronous optimizer step (no staleness; the default on CPU workers)",
    )
    step.add_argument(
        "--async-step",
        dest="async_step",
        action="store_true",
        help="asynchronous, one-step-stale optimizer step (the default on GPUs)",
    )
    p.set_defaults(async_step=None)  # None: the strategy follows the hardware
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--val-every", type=int, default=40, help="validate every N training batches")
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default=None, help="checkpoint to resume training from")
    p.add_argument("--init-from", default=None, help="checkpoint whose weights start a new run")
    p.add_argument("--generate", type=int, default=200, help="bytes to sample at the end (0: none)")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="write each logged step's measured and simulated timeline to DIR (Perfetto JSON)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True)
    model = ByteLM(
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        seq_len=args.seq_len,
        dropout=args.dropout,
        lr=args.lr,
    )
    if args.init_from:
        # weights_only: a crafted checkpoint cannot run code when it is unpickled
        state = torch.load(args.init_from, map_location="cpu", weights_only=True)["state_dict"]
        model.load_state_dict(state)
    data = ByteCorpus(args.corpus, seq_len=args.seq_len, batch_size=args.batch_size)
    out = Path(args.out_dir)
    callbacks: list[L.Callback] = [
        ModelCheckpoint(
            dirpath=out / "checkpoints", monitor="val_loss", save_top_k=1, save_last=True
        ),
        LearningRateMonitor(logging_interval="step"),
    ]
    if args.strategy == "roundpipe":
        strategy: Any = RoundPipeStrategy(
            num_microbatch=args.num_microbatch,
            execute_plan=args.layout,
            async_step=args.async_step,
        )
        # at the Trainer's log_every_n_steps, beside Lightning's own scalars
        callbacks.append(StageTimeLogger(trace_dir=args.trace))
        if args.auto_replan:
            callbacks.append(AutoReplan(warmup_steps=10))
        devices = args.devices
    else:
        strategy, devices = "auto", 1
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=devices,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        log_every_n_steps=10,
        logger=TensorBoardLogger(out, name="byte_lm"),
        callbacks=callbacks,
        enable_progress_bar=not args.no_progress_bar,
        num_sanity_val_steps=0,
    )
    losses: list[float] = []

    class KeepLosses(L.Callback):
        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *a: Any
        ) -> None:
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(KeepLosses())
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    seconds = time.perf_counter() - t0
    val_metric = trainer.callback_metrics.get("val_loss")
    val_loss = float(val_metric) if val_metric is not None else float("nan")
    head = sum(losses[:10]) / max(1, len(losses[:10]))
    tail = sum(losses[-10:]) / max(1, len(losses[-10:]))
    val_said = (
        f"val loss {val_loss:.3f} ({val_loss / math.log(2):.2f} bits/byte)"
        if val_metric is not None
        else f"validation did not run (it runs every {args.val_every} training batches)"
    )
    print(
        f"\ntrained {len(losses)} steps in {seconds:.1f} s: train loss {head:.3f} -> {tail:.3f} "
        f"(first/last 10 steps), {val_said}"
    )
    ckpt = trainer.checkpoint_callback
    if ckpt is not None and ckpt.best_model_path:
        print(f"best checkpoint: {ckpt.best_model_path}")
    print(f"TensorBoard: tensorboard --logdir {out}")
    if args.generate > 0:
        print("\nsample:\n" + model.generate("The river ", num_bytes=args.generate))
    return {
        "losses": losses,
        "val_loss": val_loss,
        "seconds": seconds,
        "trainer": trainer,
        "model": model,
    }


if __name__ == "__main__":
    main()
