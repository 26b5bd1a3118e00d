"""``overlap_iterations=True``: training_step's ``forward_backward`` runs non-blocking
and returns a lazy loss; the numbers stay those of the documented stale-1 rule."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from rpl_helpers import (
    BATCH,
    SeqModule,
    loader,
    max_rel_err,
    params_of,
    rp_trainer,
    scheduled_sgd,
    stale_one_reference,
)
from torch import nn

from roundpipe_lightning._overlap import LazyLoss
from roundpipe_lightning.session import QueuedStep

ACC = 2
STEPS = 10
N = 2 * ACC * STEPS * BATCH // 2  # one epoch of STEPS windows


class Scheduled(SeqModule):
    """SGD with momentum (sensitive to the gradient's scale) and a per-step LambdaLR;
    records the training_step results without reading them."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.results: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)
        self.results.append(loss)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return scheduled_sgd(self.parameters())


def reference(clip: float | None = None) -> dict[str, torch.Tensor]:
    """The stale-1 rule over this file's windows of ACC batches."""
    return stale_one_reference(list(loader(N)), STEPS, ACC, clip)


def fit(
    overlap: bool, clip: float | None = None, module: Scheduled | None = None, **kw: Any
) -> Scheduled:
    m = module if module is not None else Scheduled()
    rp_trainer(
        max_steps=STEPS,
        async_step=True,
        accumulate_grad_batches=ACC,
        gradient_clip_val=clip,
        strategy_kw={"overlap_iterations": overlap},
        **kw,
    ).fit(m, loader(N))
    return m


@pytest.mark.parametrize("clip", [None, 0.05])
def test_overlapped_training_is_the_stale_one_rule(clip: float | None) -> None:
    ref = reference(clip)
    over, plain = fit(True, clip), fit(False, clip)
    assert max_rel_err(params_of(over), ref) <= 1e-6
    assert max_rel_err(params_of(plain), ref) <= 1e-6
    # the iterations were issued non-blocking (the first one runs blocking)
    assert sum(isinstance(r, LazyLoss) for r in over.results) == len(over.results) - 1
    assert not any(isinstance(r, LazyLoss) for r in plain.results)
    # the lazy losses are the losses
    assert [float(r) for r in over.results] == pytest.approx([float(r) for r in plain.results])


class Unhooked(Scheduled):
    """Scheduled without the step hook: the queued step may run layer by layer."""

    def configure_optimizers(self) -> Any:
        return scheduled_sgd(self.parameters(), slow=False)


@pytest.mark.usefixtures("concurrent_planning")  # multi-stage plans on CPU workers
def test_layerwise_step_keeps_the_stale_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without clipping or step hooks, an overlapped window's step runs parameter by
    parameter as the gradients complete (step_layerwise); the numbers do not change."""
    parts: list[int | None] = []
    run = QueuedStep.run

    def recording(self: QueuedStep, params: Any = None, **kw: Any) -> Any:
        parts.append(None if params is None else len(params))
        return run(self, params, **kw)

    monkeypatch.setattr(QueuedStep, "run", recording)
    m = fit(True, module=Unhooked())
    assert max_rel_err(params_of(m), reference()) <= 1e-6
    n_params = len(list(m.parameters()))
    assert None not in parts[1:], parts  # every overlapped window stepped layer-wise
    assert sum(p or n_params for p in parts) == STEPS * n_params
    assert len(parts) > STEPS, parts  # in several parts


def test_lazy_loss_is_not_waited_for_by_the_loop() -> None:
    """Returning and logging the loss does not resolve it: at the next training_step
    the previous iteration's loss may still be pending."""
    seen: list[bool] = []

    class Peek(Scheduled):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.results and isinstance(self.results[-1], LazyLoss):
                seen.append(self.results[-1].resolved)
            return super().training_step(batch, batch_idx)

    fit(True, module=Peek())
    assert seen and not all(seen), seen  # at least one was still lazy one iteration later


class ReadsGrads(Scheduled):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norms = [p.grad.norm() for g in optimizer.param_groups for p in g["params"]]


def test_hooks_reading_gradients_keep_it_blocking(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="roundpipe_lightning.strategy")
    m = ReadsGrads()
    rp_trainer(max_steps=3, async_step=True, strategy_kw={"overlap_iterations": True}).fit(
        m, loader()
    )
    assert not any(isinstance(r, LazyLoss) for r in m.results)
    assert any("on_before_optimizer_step" in r.getMessage() for r in caplog.records)


def test_explicit_blocking_is_respected() -> None:
    class Blocking(Scheduled):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = self.roundpipe.forward_backward(
                input_args=(x,), label=y, loss_fn=self.loss_fn, blocking=True
            )
            self.results.append(loss)
            return loss

    m = Blocking()
    rp_trainer(max_steps=3, async_step=True, strategy_kw={"overlap_iterations": True}).fit(
        m, loader()
    )
    assert m.results and not any(isinstance(r, LazyLoss) for r in m.results)


def test_lazy_loss_behaves_like_its_value() -> None:
    calls = []

    def value() -> torch.Tensor:
        calls.append(1)
        return torch.tensor(3.0)

    lazy = LazyLoss(value, torch.Size([]), torch.float32)
    derived = (lazy.detach().clone() / 2 + torch.zeros(())).to(torch.float64)
    assert isinstance(derived, LazyLoss) and derived.dtype == torch.float64 and not calls
    assert float(derived) == 1.5 and calls == [1]
    assert lazy.item() == 3.0 and calls == [1]  # computed once
    assert torch.equal(copy.deepcopy(lazy), torch.tensor(3.0))


def test_overlap_iterations_must_be_bool() -> None:
    from roundpipe_lightning import RoundPipeStrategy

    with pytest.raises(TypeError, match="overlap_iterations"):
        RoundPipeStrategy(overlap_iterations=1)  # type: ignore[arg-type]


def test_checkpoint_resume_and_validation_match_the_blocking_run(tmp_path: Path) -> None:
    """Checkpoints taken mid-run (with validation in between) hold the weights the
    blocking run's hold, resume to the same weights, and save the lazy monitored loss
    as a plain number."""

    def run(overlap: bool) -> tuple[dict, dict, Scheduled]:
        def trainer(max_steps: int, callbacks: list) -> L.Trainer:
            return rp_trainer(
                max_steps=max_steps,
                async_step=True,
                accumulate_grad_batches=ACC,
                val_check_interval=4,
                limit_val_batches=1,
                enable_checkpointing=True,
                callbacks=callbacks,
                default_root_dir=tmp_path,  # the resumed run's default ModelCheckpoint
                strategy_kw={"overlap_iterations": overlap},
            )

        d = tmp_path / str(overlap)
        a = Scheduled()
        ck = ModelCheckpoint(dirpath=d, every_n_train_steps=3, monitor="train_loss")
        trainer(3, [ck]).fit(a, loader(N), loader())
        (path,) = d.glob("*.ckpt")
        a2 = Scheduled(seed=7)
        trainer(STEPS, []).fit(a2, loader(N), loader(), ckpt_path=path)
        return torch.load(path, weights_only=True), params_of(a2), a2

    saved, resumed, m = run(True)
    saved_ref, resumed_ref, _ = run(False)
    assert max_rel_err(saved["state_dict"], saved_ref["state_dict"]) <= 1e-6
    assert max_rel_err(resumed, resumed_ref) <= 1e-6
    assert any(isinstance(r, LazyLoss) for r in m.results)
    score = next(iter(saved["callbacks"].values()))["best_model_score"]
    assert type(score) is torch.Tensor and torch.isfinite(score)


class Tripwire(nn.Module):
    """Identity that fails on an input marked by a huge value (one batch of the data)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e6:
            raise RuntimeError("tripwire layer failed")
        return x


class Tripped(Scheduled):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.net.insert(0, Tripwire())


def test_failed_iteration_is_not_counted_in_the_exception_checkpoint(tmp_path: Path) -> None:
    """An overlapped iteration fails on a worker: the error reaches the caller and the
    checkpoint saved on the exception records exactly the steps its weights received."""
    dl = loader(N)
    dl.dataset.tensors[0][5 * BATCH] = 1e7  # batch 5 (window 2)
    m = Tripped()
    saver = OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")
    with pytest.raises(RuntimeError, match="tripwire layer failed"):
        rp_trainer(
            max_steps=STEPS,
            async_step=True,
            accumulate_grad_batches=ACC,
            callbacks=[saver],
            enable_checkpointing=True,
        ).fit(m, dl)
    ckpt = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    steps = ckpt["global_step"]
    assert steps <= 2
    ref = Tripped()
    if steps:
        rp_trainer(
            max_steps=steps,
            async_step=True,
            accumulate_grad_batches=ACC,
            strategy_kw={"overlap_iterations": False},
        ).fit(ref, loader(N))
    got = {k: v.float() for k, v in ckpt["state_dict"].items()}
    assert max_rel_err(got, params_of(ref)) <= 1e-6
