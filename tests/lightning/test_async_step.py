"""``async_step=True``: the queued optimizer step is the one plain Lightning would take
(its own hyperparameters, one step stale as documented), users never read weights a
step behind, and a failed step is not counted."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from rpl_helpers import (
    FailsAtThirdStep,
    SeqModule,
    loader,
    max_rel_err,
    params_of,
    rp_trainer,
    scheduled_sgd,
    stale_one_reference,
)

TOL = 1e-5
STEPS = 5


class PerStepSchedule(SeqModule):
    def configure_optimizers(self):
        return scheduled_sgd(self.parameters())


def test_queued_step_uses_its_own_learning_rate() -> None:
    runs = []
    for _ in range(2):
        m = PerStepSchedule()
        rp_trainer(max_steps=STEPS, async_step=True).fit(m, loader())
        runs.append(params_of(m))
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), f"{name}: seeded runs differ"
    assert max_rel_err(runs[0], stale_one_reference(list(loader())[:STEPS], STEPS)) <= TOL


class WeightReader(L.Callback):
    """Records, at each hook where users read weights, whether the module's weights
    are already those of every step taken so far."""

    def __init__(self) -> None:
        self.stale: list[str] = []

    def _check(self, hook: str, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seen = params_of(pl_module)
        trainer.strategy.roundpipe.synchronize()
        if max_rel_err(seen, params_of(pl_module)) != 0.0:
            self.stale.append(hook)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._check("callback.on_train_epoch_end", trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._check("callback.on_train_end", trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._check("callback.on_validation_start", trainer, pl_module)


class ReadsWeights(SeqModule):
    def __init__(self, reader: WeightReader, **kw) -> None:
        super().__init__(**kw)
        self.reader = reader

    def on_train_epoch_end(self) -> None:
        self.reader._check("module.on_train_epoch_end", self.trainer, self)

    def on_train_end(self) -> None:
        self.reader._check("module.on_train_end", self.trainer, self)


def test_hooks_never_see_weights_a_step_behind() -> None:
    reader = WeightReader()
    m = ReadsWeights(reader)
    t = rp_trainer(
        max_epochs=2, async_step=True, callbacks=[reader], val_check_interval=3, limit_val_batches=1
    )
    t.fit(m, loader(), loader())
    assert reader.stale == []


def test_failed_async_step_is_not_counted_in_the_exception_checkpoint(tmp_path: Path) -> None:
    m = FailsAtThirdStep()
    saver = OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")
    with pytest.raises(RuntimeError, match="optimizer blew up"):
        rp_trainer(max_steps=6, async_step=True, callbacks=[saver], enable_checkpointing=True).fit(
            m, loader()
        )
    ckpt = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    # two steps were applied to the weights it holds
    assert ckpt["global_step"] == 2
    ref = SeqModule(optimizer="sgd", lr=0.1)
    ref.configure_optimizers = lambda: torch.optim.SGD(ref.parameters(), lr=0.1)
    rp_trainer(max_steps=2, async_step=True).fit(ref, loader())
    want = params_of(ref)
    assert max_rel_err({k: v.float() for k, v in ckpt["state_dict"].items()}, want) == 0.0


def test_the_optimizer_pickles_as_its_own_class_during_an_async_fit() -> None:
    """While an async fit runs, the user's optimizer keeps its own class (the queued
    step runs on a twin with the step's groups): pickling or copying it gives a plain
    instance of the user's class with the same state."""
    import pickle

    seen: dict[str, Any] = {}

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            opt = trainer.optimizers[0]
            seen["own_class"] = type(opt) is torch.optim.SGD
            for how, copied in (
                ("pickle", pickle.loads(pickle.dumps(opt))),
                ("deepcopy", copy.deepcopy(opt)),
            ):
                seen[how] = (type(copied), len(copied.state_dict()["state"]))

    class Momentum(SeqModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    m = Momentum()
    rp_trainer(max_steps=3, async_step=True, callbacks=[Snapshot()]).fit(m, loader())
    assert seen["own_class"]  # no class of ours in the user's object
    n = len(list(m.parameters()))
    assert seen["pickle"] == seen["deepcopy"] == (torch.optim.SGD, n)


def _sgd_with_grad(lr: float = 0.1, **kw: Any) -> tuple[torch.nn.Parameter, torch.optim.SGD]:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    return p, torch.optim.SGD([p], lr=lr, **kw)


def test_queued_step_runs_with_the_queued_hyperparameters_on_a_twin() -> None:
    from roundpipe_lightning.session import QueuedStep

    p, opt = _sgd_with_grad(momentum=0.9)
    queued = QueuedStep(opt)
    opt.param_groups[0]["lr"] = 100.0  # a scheduler sets the next step's value meanwhile
    queued.run()
    assert torch.allclose(p.detach(), torch.full((2,), 0.9))  # lr 0.1, not 100
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 100.0
    assert "momentum_buffer" in opt.state[p]  # the twin shares the user's state


def test_queued_step_carries_back_what_the_step_rebinds() -> None:
    from roundpipe_lightning.session import QueuedStep

    class Counting(torch.optim.SGD):
        calls = 0

        def step(self, closure: Any = None) -> Any:
            self.calls += 1  # rebinds an instance attribute
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = Counting([p], lr=0.1)
    QueuedStep(opt).run()
    QueuedStep(opt).run()
    assert opt.calls == 2 and type(opt) is Counting


def test_queued_step_binds_an_instance_method_step_to_the_twin() -> None:
    import types

    from roundpipe_lightning.session import QueuedStep

    p, opt = _sgd_with_grad()
    seen_lr = []

    def step(self: Any, closure: Any = None) -> Any:
        seen_lr.append(self.param_groups[0]["lr"])
        return torch.optim.SGD.step(self, closure)

    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
    queued = QueuedStep(opt)
    opt.param_groups[0]["lr"] = 100.0
    queued.run()
    assert seen_lr == [0.1]
    assert torch.allclose(p.detach(), torch.full((2,), 0.9))


def test_queued_step_warns_when_a_wrapper_must_read_the_live_groups() -> None:
    from roundpipe_lightning.session import QueuedStep

    p, opt = _sgd_with_grad()
    real = opt.step
    opt.step = lambda *a, **k: real(*a, **k)  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="replaced on the instance"):
        QueuedStep(opt).run()
    assert torch.allclose(p.detach(), torch.full((2,), 0.9))
