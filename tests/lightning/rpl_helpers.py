"""Shared pieces of the Lightning tests: a small Sequential LightningModule that can
train through RoundPipe or plainly, its data, Trainer factories and comparisons."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from roundpipe_lightning import RoundPipeStrategy

IN_DIM, HIDDEN, OUT_DIM = 8, 16, 4
BATCH = 6
NUM_SAMPLES = 30  # 5 batches per epoch


def make_data(n: int = NUM_SAMPLES, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN_DIM, generator=g), torch.randn(n, OUT_DIM, generator=g))


def loader(
    n: int = NUM_SAMPLES, batch_size: int = BATCH, seed: int = 1, shuffle: bool = False
) -> DataLoader:
    return DataLoader(make_data(n, seed), batch_size=batch_size, shuffle=shuffle)


class Heavy(nn.Module):
    """A layer whose compute time is many times its neighbours' (``rounds`` small matmuls)
    while its parameters stay small: only measured times reveal it."""

    def __init__(self, rounds: int) -> None:
        super().__init__()
        self.rounds = rounds
        self.weight = nn.Parameter(torch.eye(HIDDEN) + 0.01 * torch.randn(HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.rounds):
            x = torch.tanh(x @ self.weight)
        return x


def build_net(seed: int = 0, dropout: float = 0.0, heavy: int = 0, wide: int = 0) -> nn.Sequential:
    """Linear/Tanh layers, one nn.Sequential child each (7 layers). For planner tests
    ``heavy`` > 0 inserts a compute-heavy layer at index 2, ``wide`` > 0 a pair of
    parameter-heavy layers there."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN_DIM, HIDDEN), nn.Tanh()]
    if heavy:
        layers.append(Heavy(heavy))
    if wide:
        layers += [nn.Linear(HIDDEN, wide), nn.Linear(wide, HIDDEN)]
    layers += [nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_DIM)]
    return nn.Sequential(*layers)


class SeqModule(L.LightningModule):
    """A regression MLP.

    Args:
        mode: "roundpipe" (``forward_backward``), "roundpipe_nonblocking"
            (``forward_backward(..., blocking=False).result()``), "rp_forward" (``self.roundpipe(x)`` +
            backward through autograd) or "plain" (``self.net(x)``, for the default strategy).
        manual: manual optimization (``accumulate`` and ``clip`` handled in training_step).
        accumulate: manual optimization only: step every this many batches.
        clip: manual optimization only: ``self.clip_gradients`` value before the step.
        scheduler: add a StepLR scheduler.
        lr: learning rate.
        optimizer: "adamw" or "sgd" (SGD with momentum is not invariant to the gradient's
            scale, so it exposes a wrong accumulation factor that Adam would hide).
    """

    def __init__(
        self,
        mode: str = "roundpipe",
        manual: bool = False,
        accumulate: int = 1,
        clip: float | None = None,
        clip_algorithm: str = "norm",
        scheduler: bool = False,
        lr: float = 1e-2,
        seed: int = 0,
        dropout: float = 0.0,
        heavy: int = 0,
        wide: int = 0,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_net(seed, dropout, heavy, wide)
        self.automatic_optimization = not manual
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def configure_sequential(self) -> nn.Module:
        return self.net

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # A batch mean, as in plain Lightning: RoundPipeStrategy's loss_reduction="mean"
        # weights each microbatch's mean by its share of the batch.
        scale = self.hparams.accumulate if not self.automatic_optimization else 1
        return ((out.float() - y.float()) ** 2).sum(-1).mean() / scale

    def _loss_and_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mode = self.hparams.mode
        if mode == "roundpipe":
            return self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)
        if mode == "roundpipe_nonblocking":
            pending = self.roundpipe.forward_backward(
                input_args=(x,), label=y, loss_fn=self.loss_fn, blocking=False
            )
            return pending.result()
        out = self.roundpipe(x) if mode == "rp_forward" else self.net(x)
        loss = self.loss_fn(out, y)
        if not self.automatic_optimization:
            self.manual_backward(loss)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.automatic_optimization:
            loss = self._loss_and_backward(x, y)
            self.losses.append(float(loss.detach()))
            self.log("train_loss", loss.detach())
            return loss
        opt = self.optimizers()
        loss = self._loss_and_backward(x, y)
        self.losses.append(float(loss.detach()))
        if (batch_idx + 1) % self.hparams.accumulate == 0:
            if self.hparams.clip is not None:
                self.clip_gradients(opt, self.hparams.clip, self.hparams.clip_algorithm)
            opt.step()
            opt.zero_grad()
            sch = self.lr_schedulers()
            if sch is not None:
                sch.step()
        return loss.detach()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self.net(x) if self.hparams.mode == "plain" else self.roundpipe(x)
        loss = self.loss_fn(out, y)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss)

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        if not self.hparams.scheduler:
            return opt
        sch = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


VOCAB, SEQ, WIDTH = 64, 12, 16


class ResidualMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


class TinyLM(L.LightningModule):
    """Token-id LM (embedding, two residual blocks, head) with a torchmetrics metric."""

    def __init__(self, mode: str = "roundpipe", seed: int = 0) -> None:
        super().__init__()
        import torchmetrics

        self.mode = mode
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Embedding(VOCAB, WIDTH),
            ResidualMLP(WIDTH),
            ResidualMLP(WIDTH),
            nn.Linear(WIDTH, VOCAB),
        )
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(
            num_classes=VOCAB, average="micro"
        )
        self.val_ce = torchmetrics.MeanMetric()

    def configure_sequential(self) -> nn.Module:
        return self.net

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.mode == "plain":
            return self.loss_fn(self.net(x), y)
        return self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) if self.mode == "plain" else self.roundpipe(x)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self._logits(x)
        self.val_acc.update(logits.flatten(0, 1), y.flatten())
        self.val_ce.update(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
        self.log("val_acc", self.val_acc)
        self.log("val_ce", self.val_ce)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._logits(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def token_loader(n: int = NUM_SAMPLES, seed: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=BATCH, shuffle=False)


def trainer_kwargs(**kw: Any) -> dict[str, Any]:
    base = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
    )
    base.update(kw)
    return base


def rp_trainer(
    devices: int = 2,
    num_microbatch: int = 3,
    async_step: bool = False,
    strategy_kw: dict | None = None,
    **kw: Any,
) -> L.Trainer:
    strategy = RoundPipeStrategy(
        num_microbatch=num_microbatch, async_step=async_step, **(strategy_kw or {})
    )
    return L.Trainer(**trainer_kwargs(strategy=strategy, devices=devices, **kw))


def plain_trainer(**kw: Any) -> L.Trainer:
    return L.Trainer(**trainer_kwargs(devices=1, **kw))


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().float() for n, p in module.named_parameters()}


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def roundpipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("roundpipe")]


class FailsAtThirdStep(SeqModule):
    """SGD whose third step raises (failure-path tests)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        calls = {"n": 0}
        real_step = opt.step

        def step(*a, **k):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("optimizer blew up")
            return real_step(*a, **k)

        opt.step = step
        return opt


# -- the stale-1 rule under a per-step schedule (async step and overlapped iterations) --
LR_FACTORS = [1.0, 0.1, 2.0, 0.5, 3.0, 0.2, 1.5]


def lr_lambda(step: int) -> float:
    return LR_FACTORS[step % len(LR_FACTORS)]


def slow_start(optimizer: Any, args: Any, kwargs: Any) -> None:
    # the queued step starts only after Lightning has stepped the scheduler on the main
    # thread: a step that read the live param_groups would get the next step's lr
    time.sleep(0.02)


def scheduled_sgd(params: Any, slow: bool = True) -> dict[str, Any]:
    """``configure_optimizers``' answer: SGD with momentum (sensitive to the gradient's
    scale) and a per-step LambdaLR; ``slow``: a step pre-hook that delays the step."""
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if slow:
        opt.register_step_pre_hook(slow_start)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


def stale_one_reference(
    batches: list[Any], steps: int, acc: int = 1, clip: float | None = None
) -> dict[str, torch.Tensor]:
    """Plain PyTorch with RoundPipe's documented async semantics: window k's gradient
    (the mean over its ``acc`` batches) is taken at the weights before step k-1 (one
    step stale), clipped to ``clip``, then step k runs with the lr the scheduler gives
    step k (:func:`scheduled_sgd`)."""
    net = build_net(0)
    compute = copy.deepcopy(net)
    conf = scheduled_sgd(net.parameters(), slow=False)
    opt, sch = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    for k in range(steps):
        compute.zero_grad()
        for x, y in batches[k * acc : (k + 1) * acc]:
            (((compute(x) - y) ** 2).sum() / BATCH / acc).backward()
        for p, q in zip(net.parameters(), compute.parameters()):
            p.grad = q.grad.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        before = copy.deepcopy(net.state_dict())
        opt.step()
        opt.zero_grad()
        sch.step()
        compute.load_state_dict(before)
    return {f"net.{n}": p.detach().clone() for n, p in net.named_parameters()}
