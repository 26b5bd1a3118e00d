"""Each private touch of Lightning or torch (``roundpipe_lightning/_private.py``) checked
against the installed versions, and no other module of the adapter reaching a private
name of Lightning, torch or the engine."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn

from roundpipe_lightning import _private

pytestmark = pytest.mark.host_only

PACKAGE = Path(_private.__file__).parent


def _own_names() -> set[str]:
    """Every name the adapter defines or assigns (its own private attributes included)."""
    names: set[str] = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _private_uses(path: Path, own: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            if module.startswith(("lightning", "torch", "roundpipe_core")):
                if any(part.startswith("_") for part in module.split(".")):
                    found.append(f"line {node.lineno}: private module {module}")
                found += [
                    f"line {node.lineno}: private name {a.name} from {module}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in own
        ):
            base = node.value
            on_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
            on_super = (
                isinstance(base, ast.Call)
                and isinstance(base.func, ast.Name)
                and base.func.id == "super"
            )
            if not (on_self or on_super):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.glob("*.py") if p.name != "_private.py"),
    ids=lambda p: p.name,
)
def test_only_the_private_module_touches_private_names(path: Path) -> None:
    assert _private_uses(path, _own_names()) == []


def test_the_scan_finds_a_private_touch(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from lightning.pytorch.trainer import call as _call\n"
        "from lightning.fabric.utilities.types import _PATH\n"
        "def f(lm, rp):\n    _call._call_callback_hooks(lm, 'x')\n"
        "    return lm._trainer, rp._grad_hooks\n"
    )
    assert len(_private_uses(bad, set())) == 4


def _sgd() -> torch.optim.SGD:
    p = nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    return torch.optim.SGD([p], lr=0.1)


def test_lr_scheduler_step_wrapper_and_its_called_mark() -> None:
    opt = _sgd()
    assert not _private.is_lr_scheduler_step_wrapper(opt.step)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    assert _private.is_lr_scheduler_step_wrapper(opt.step)
    _private.mark_lr_scheduler_step_called(opt)  # the step itself runs later, elsewhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "scheduler.step() before optimizer.step()"
        sched.step()


def test_mark_without_a_scheduler_adds_nothing() -> None:
    opt = _sgd()
    _private.mark_lr_scheduler_step_called(opt)
    assert "_opt_called" not in vars(opt)


class _Tiny(L.LightningModule):
    def __init__(self, automatic: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.automatic_optimization = automatic

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.lin(batch[0]).pow(2).sum()
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> Any:
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    return torch.utils.data.DataLoader(data, batch_size=2)


def _trainer(**kw: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


@pytest.mark.parametrize("automatic", [True, False])
def test_uncounted_saved_steps_resume_at_the_corrected_step(
    tmp_path: Path, automatic: bool
) -> None:
    trainer = _trainer(max_steps=3)
    trainer.fit(_Tiny(automatic), _loader())
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    assert checkpoint["global_step"] == 3
    _private.uncount_saved_steps(checkpoint, 2, automatic)
    assert checkpoint["global_step"] == 1
    path = tmp_path / "c.ckpt"
    torch.save(checkpoint, path)

    seen = {}

    class AtStart(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen["step"] = trainer.global_step

    _trainer(max_steps=2, callbacks=[AtStart()]).fit(_Tiny(automatic), _loader(), ckpt_path=path)
    assert seen["step"] == 1  # Lightning restores the count from the corrected progress


def test_uncounting_nothing_leaves_the_checkpoint_alone() -> None:
    checkpoint = {"global_step": 3, "loops": {}}
    _private.uncount_saved_steps(checkpoint, 0, True)
    assert checkpoint == {"global_step": 3, "loops": {}}


def test_lightning_log_step_is_the_step_lightning_logs_at() -> None:
    logged, ours = [], []

    class Logs(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.lin(batch[0]).sum()
            self.log("loss", loss)
            return loss

        def on_train_batch_end(self, *args: Any) -> None:
            ours.append(_private.lightning_log_step(self.trainer))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Recorder(L.pytorch.loggers.CSVLogger):
        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            logged.append(step)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        log_every_n_steps=1,
        logger=Recorder(save_dir="/tmp"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Logs(), _loader())
    assert logged[:4] == ours == [0, 1, 2, 3]


def test_before_optimizer_step_hooks_run_for_callbacks_and_module() -> None:
    calls = []

    class Module(_Tiny):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            calls.append("module")

    class Cb(Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            calls.append("callback")

    trainer = _trainer(max_steps=1, callbacks=[Cb()])
    module = Module()
    trainer.fit(module, _loader())
    calls.clear()
    _private.call_before_optimizer_step_hooks(trainer, trainer.optimizers[0])
    assert calls == ["callback", "module"]


def test_wrapper_tensor_and_mutable_ops() -> None:
    class Empty(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            raise AssertionError("not dispatched in this test")

    t = _private.make_wrapper_tensor(Empty, torch.Size([2, 3]), torch.float16)
    assert isinstance(t, Empty) and t.shape == (2, 3) and t.dtype == torch.float16
    assert t.device.type == "cpu" and not t.requires_grad
    assert _private.op_is_mutable(torch.ops.aten.add_.Tensor)
    assert not _private.op_is_mutable(torch.ops.aten.add.Tensor)


def test_wrapping_checkpoint_io_is_the_base_of_async_checkpoint_io() -> None:
    assert isinstance(AsyncCheckpointIO(), _private.WrappingCheckpointIO)


def test_deferred_zero_grad_keeps_gradients_until_restored() -> None:
    opt = _sgd()
    real = _private.defer_zero_grad(opt)
    param = opt.param_groups[0]["params"][0]
    opt.zero_grad()
    assert param.grad is not None  # deferred: the RoundPipe step clears them
    real(set_to_none=True)
    assert param.grad is None
    _private.restore_zero_grad(opt)
    assert "zero_grad" not in vars(opt) and type(opt).zero_grad is torch.optim.SGD.zero_grad


def test_replaced_zero_grad_runs_instead_and_is_restored() -> None:
    opt = _sgd()
    calls: list[bool] = []
    real = _private.defer_zero_grad(opt, lambda set_to_none=True: calls.append(set_to_none))
    opt.zero_grad(set_to_none=False)
    assert calls == [False] and opt.param_groups[0]["params"][0].grad is not None
    real()
    assert opt.param_groups[0]["params"][0].grad is None
    _private.restore_zero_grad(opt)
    assert "zero_grad" not in vars(opt)


def test_fabrics_optimizer_wrapper_reaches_the_views_zero_grad() -> None:
    """Fabric's wrapper takes the wrapped optimizer's class as a base and finds zero_grad
    there: around the view, it must call the policy, never the class's zero_grad."""
    from lightning.fabric import Fabric

    opt = _sgd()
    param = opt.param_groups[0]["params"][0]
    calls: list[bool] = []
    view = _private.optimizer_view(opt, lambda set_to_none=True: calls.append(set_to_none))
    assert isinstance(view, torch.optim.SGD) and vars(view) is vars(opt)
    fabric = Fabric(accelerator="cpu", devices=1)
    _, wrapped = fabric.setup(nn.Linear(1, 1), view)
    wrapped.zero_grad()
    view.zero_grad(set_to_none=False)
    assert calls == [True, False] and param.grad is not None
    assert wrapped.param_groups is opt.param_groups  # one optimizer: groups, state, hooks
    _private.restore_zero_grad(opt)
    assert "roundpipe_zero_grad" not in vars(opt)


def test_replaced_zero_grad_shadows_the_lightning_optimizers_class_method() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = _sgd()
    wrapper = LightningOptimizer(opt)
    calls = []
    _private.defer_zero_grad(wrapper, lambda set_to_none=True: calls.append(set_to_none))
    param = opt.param_groups[0]["params"][0]
    wrapper.zero_grad()
    assert calls == [True] and param.grad is not None  # the replacement ran, not the class's
    _private.restore_zero_grad(wrapper)
    wrapper.zero_grad()
    assert param.grad is None and calls == [True]
