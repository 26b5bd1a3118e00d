"""What a Lightning user can get wrong, or that used to go silently wrong under the
strategy (issue 23): each case either gives the right numbers or a clear error."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rpl_helpers import SeqModule, loader, max_rel_err, params_of, rp_trainer

TOL = 1e-6


class ZeroGradFirst(SeqModule):
    """Manual optimization in the order Lightning's docs show: ``zero_grad()`` before
    the backward, then ``step()``."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)
        self.losses.append(float(loss))
        opt.step()
        return loss


@pytest.mark.parametrize("module", [SeqModule, ZeroGradFirst])
def test_manual_optimization_with_async_step_equals_automatic(module: type) -> None:
    """opt.step(); opt.zero_grad() (or zero_grad() first) with the asynchronous step: the
    user's zero_grad runs after the queued step instead of clearing the gradients it
    still reads, so manual optimization trains exactly as automatic does."""
    auto = SeqModule(optimizer="sgd")
    rp_trainer(max_steps=6, async_step=True).fit(auto, loader())
    manual = module(manual=True, optimizer="sgd")
    rp_trainer(max_steps=6, async_step=True).fit(manual, loader())
    assert max_rel_err(params_of(manual), params_of(auto)) <= TOL
    assert manual.losses == pytest.approx(auto.losses, rel=1e-6)
    # and the optimizers got their own zero_grad back at teardown
    assert "zero_grad" not in vars(manual.trainer.optimizers[0])
    assert max_rel_err(params_of(manual), params_of(SeqModule())) > 1e-2


def test_manual_zero_grad_still_clears_unstepped_gradients() -> None:
    """A zero_grad() after a forward_backward that no step consumed clears them (as in
    plain PyTorch): the ordered zero_grad is not a no-op."""

    class DiscardOdd(SeqModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            opt = self.optimizers()
            # gradients of a throw-away pass, cleared before the real one
            self.roundpipe.forward_backward(input_args=(x * 3,), label=y, loss_fn=self.loss_fn)
            opt.zero_grad()
            loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=self.loss_fn)
            self.losses.append(float(loss))
            opt.step()
            return loss

    auto = SeqModule(optimizer="sgd")
    rp_trainer(max_steps=4, async_step=True).fit(auto, loader())
    manual = DiscardOdd(manual=True, optimizer="sgd")
    rp_trainer(max_steps=4, async_step=True).fit(manual, loader())
    assert max_rel_err(params_of(manual), params_of(auto)) <= TOL


class Reordered(SeqModule):
    """``configure_optimizers`` lists the parameters in reverse order (when ``reverse``)."""

    reverse = False

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        return torch.optim.AdamW(params[::-1] if self.reverse else params, lr=1e-2)


def _fit_and_checkpoint(module: SeqModule, tmp_path: Any, steps: int = 2) -> Any:
    """Fit ``steps`` steps, saving a checkpoint after the last (during fit: the strategy
    holds the optimizer fused then)."""
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=steps, save_top_k=-1)
    trainer = rp_trainer(
        max_steps=steps, enable_checkpointing=True, callbacks=[ckpt], default_root_dir=tmp_path
    )
    trainer.fit(module, loader())
    return ckpt.best_model_path or ckpt.last_model_path or next(tmp_path.glob("*.ckpt"))


def test_resume_with_reordered_parameters_raises_naming_the_parameter(tmp_path: Any) -> None:
    """Fused kernels do not check state shapes: a checkpoint resumed while
    configure_optimizers lists the parameters in another order would train to NaN.
    The strategy refuses it at load, naming the parameter and the state entry."""
    path = _fit_and_checkpoint(Reordered(), tmp_path)
    second = Reordered()
    second.reverse = True
    trainer = rp_trainer(max_steps=4, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 'net\.\d+\.\w+' has shape"):
        trainer.fit(second, loader(), ckpt_path=path)
    assert all(torch.isfinite(p).all() for p in second.parameters())


class SeesFused(SeqModule):
    def on_train_end(self) -> None:
        self.fused_in_fit = [g.get("fused") for g in self.optimizers().optimizer.param_groups]


def test_checkpoint_keeps_the_users_fused_setting(tmp_path: Any) -> None:
    """The strategy runs the optimizer fused, but the checkpoint stores what the user
    built (fused unset), so plain Lightning resumes it with its own choice."""
    m = SeesFused()
    path = _fit_and_checkpoint(m, tmp_path)
    assert m.fused_in_fit == [True]  # what ran
    saved = torch.load(path, weights_only=False)
    assert [g.get("fused") for g in saved["optimizer_states"][0]["param_groups"]] == [None]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(checkpoint_io=object()), r"checkpoint_io must be None or a lightning CheckpointIO"),
        (dict(precision_plugin="16"), r"Trainer\(precision='16'"),
        (
            dict(precision_plugin=object()),
            r"precision_plugin must be None or a lightning Precision",
        ),
    ],
)
def test_plugins_of_the_wrong_kind_are_refused_at_construction(kwargs: dict, match: str) -> None:
    from roundpipe_lightning import RoundPipeStrategy

    with pytest.raises(TypeError, match=match):
        RoundPipeStrategy(**kwargs)


def test_checkpoint_files_get_the_umask_mode_and_write_through_symlinks(tmp_path: Any) -> None:
    import os

    from roundpipe_lightning.checkpoint_io import StreamingCheckpointIO

    io = StreamingCheckpointIO()
    old = os.umask(0o022)
    try:
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    finally:
        os.umask(old)
    assert (tmp_path / "a.ckpt").stat().st_mode & 0o777 == 0o644  # as a plain save, not 0600
    os.chmod(tmp_path / "a.ckpt", 0o640)
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "a.ckpt")
    assert (tmp_path / "a.ckpt").stat().st_mode & 0o777 == 0o640  # an existing file's mode
    # saving through a symlink writes the file it points to and keeps the link
    (tmp_path / "link.ckpt").symlink_to(tmp_path / "a.ckpt")
    io.save_checkpoint({"w": torch.full((2,), 7.0)}, tmp_path / "link.ckpt")
    assert (tmp_path / "link.ckpt").is_symlink()
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["w"].tolist() == [7.0, 7.0]


def test_a_killed_saves_temporary_file_is_removed_by_the_next_save(tmp_path: Any) -> None:
    from roundpipe_lightning.checkpoint_io import StreamingCheckpointIO

    stale = tmp_path / ".last.ckpt.k1ll3d_x.tmp"  # what SIGKILL mid-save leaves
    stale.write_bytes(b"x" * 1000)
    other = tmp_path / ".other.ckpt.k1ll3d_x.tmp"  # another target's: not ours to remove
    other.write_bytes(b"x")
    StreamingCheckpointIO().save_checkpoint({"w": torch.ones(2)}, tmp_path / "last.ckpt")
    assert not stale.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.ckpt.k1ll3d_x.tmp", "last.ckpt"]


class L2Penalty(SeqModule):
    """A loss through self.roundpipe plus an L2 term over self.parameters()."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = self.roundpipe(x)
        penalty = sum((p**2).sum() for p in self.parameters())
        return self.loss_fn(loss, y) + 1e-3 * penalty


def test_an_l2_term_over_the_network_weights_is_named() -> None:
    m = L2Penalty()
    with pytest.raises(RuntimeError) as info:
        rp_trainer(max_steps=1).fit(m, loader())
    msg = str(info.value)
    assert re.search(r"reaches the parameter '\d+\.(weight|bias)'", msg), msg
    assert "L2 penalty" in msg and "weight_decay" in msg, msg


@pytest.mark.parametrize(
    "state", ["garbage", {"plan": "garbage"}, {"plan": {"fwd": [[0]]}}, {"last_replan_step": "3"}]
)
def test_autoreplan_refuses_garbage_state(state: Any) -> None:
    from roundpipe_lightning import AutoReplan

    with pytest.raises(
        ValueError, match="AutoReplan: the checkpoint's AutoReplan state is not valid"
    ):
        AutoReplan().load_state_dict(state)


def test_autoreplan_plan_for_other_devices_names_the_checkpoint() -> None:
    from roundpipe_core import ModelExecutePlan
    from roundpipe_lightning import AutoReplan

    plan = ModelExecutePlan.uniform(7, 2).to_dict()
    plan["bwd_owners"] = [2, 3]  # devices of a 4-device run; this pool has 2
    replan = AutoReplan()
    replan.load_state_dict({"plan": plan, "last_replan_step": 3, "run_type": replan.run_type})
    with pytest.raises(ValueError, match="the plan restored from the checkpoint .* does not fit"):
        rp_trainer(max_steps=1, callbacks=[replan]).fit(SeqModule(), loader())
