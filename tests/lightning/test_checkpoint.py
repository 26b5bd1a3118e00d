"""Checkpoints: LightningModule state-dict names, fp32 masters, optimizer state, exact
resume (synchronous and asynchronous step), loading without RoundPipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rpl_helpers import SeqModule, loader, max_rel_err, params_of, plain_trainer, rp_trainer

# 5 batches per epoch: step 10 ends an epoch, so the resumed run sees the same batches.


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_resume_is_identical_to_straight_run(
    tmp_path: Path, async_step: bool, precision: str
) -> None:
    _assert_resume_matches_straight_run(tmp_path, async_step=async_step, precision=precision)


@pytest.mark.cpu_backend  # (CPU workers even under ROUNDPIPE_TEST_DEVICE=fake-cuda)
def test_resume_with_cpu_workers_side_by_side_is_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``ROUNDPIPE_CPU_CONCURRENT=1`` the checkpoint keeps which stages draw random
    numbers (``checkpoint["roundpipe"]["draws"]``): a resumed run that re-learned them
    would compute its first microbatches alone, on the whole thread budget, where the
    straight run shared the cores (bf16 sums then differ in their last bits)."""
    monkeypatch.setenv("ROUNDPIPE_CPU_CONCURRENT", "1")
    ckpt = _assert_resume_matches_straight_run(tmp_path, async_step=False, precision="bf16-true")
    rows = torch.load(ckpt, weights_only=True)["roundpipe"]["draws"]
    assert rows and all(runs >= 2 for *_, runs in rows), rows  # learned: no stage draws


def _assert_resume_matches_straight_run(tmp_path: Path, **kw: object) -> Path:
    """10 steps, a checkpoint, 10 resumed steps: the losses, weights and the checkpoint
    equal those of 20 straight steps; returns the checkpoint resumed from."""
    # run A: 10 steps (ModelCheckpoint saves at step 10), then resume to 20
    a = SeqModule()
    ca = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=10, save_top_k=-1)
    rp_trainer(max_steps=10, enable_checkpointing=True, callbacks=[ca], **kw).fit(a, loader())
    ckpt = tmp_path / "a" / "epoch=1-step=10.ckpt"
    a2 = SeqModule(seed=123)  # different init: everything must come from the checkpoint
    rp_trainer(max_steps=20, **kw).fit(a2, loader(), ckpt_path=ckpt)

    # run B: 20 straight; its checkpoint at step 10 drains the asynchronous step as A's did
    b = SeqModule()
    cb = ModelCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=10, save_top_k=-1)
    rp_trainer(max_steps=20, enable_checkpointing=True, callbacks=[cb], **kw).fit(b, loader())

    assert len(a.losses) == 10 and len(a2.losses) == 10 and len(b.losses) == 20
    assert a.losses + a2.losses == b.losses
    pa, pb = params_of(a2), params_of(b)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    # the checkpoint B wrote at step 10 holds what A saved
    sa = torch.load(ckpt, weights_only=True)
    sb = torch.load(tmp_path / "b" / "epoch=1-step=10.ckpt", weights_only=True)
    for k, v in sa["state_dict"].items():
        assert torch.equal(v, sb["state_dict"][k]), k
    return ckpt


def test_checkpoint_contents(tmp_path: Path) -> None:
    m = SeqModule()
    t = rp_trainer(max_steps=3, precision="bf16-true")
    t.fit(m, loader())
    path = tmp_path / "m.ckpt"
    t.save_checkpoint(path)
    ck = torch.load(path, weights_only=True)  # only safe types: loads under weights_only too
    names = [n for n, _ in m.named_parameters()]
    # model weights under the LightningModule's own names, in the model's dtype
    assert list(ck["state_dict"]) == [n for n in m.state_dict()]
    assert all(n.startswith("net.") for n in ck["state_dict"])
    assert all(v.dtype == torch.bfloat16 for v in ck["state_dict"].values())
    # fp32 masters for every trainable parameter (they differ in dtype from the model)
    masters = ck["roundpipe"]["masters"]
    assert sorted(masters) == sorted(names)
    assert all(v.dtype == torch.float32 for v in masters.values())
    for n in names:
        assert torch.equal(masters[n].to(torch.bfloat16), ck["state_dict"][n])
    # optimizer state is over the fp32 masters
    state = ck["optimizer_states"][0]["state"]
    assert len(state) == len(names)
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())


def test_fp32_checkpoint_stores_no_duplicate_masters(tmp_path: Path) -> None:
    m = SeqModule()
    t = rp_trainer(max_steps=2)
    t.fit(m, loader())
    t.save_checkpoint(tmp_path / "m.ckpt")
    ck = torch.load(tmp_path / "m.ckpt", weights_only=True)
    assert ck["roundpipe"]["masters"] == {}  # fp32 masters == fp32 weights after synchronize


def test_checkpoint_loads_into_plain_module(tmp_path: Path) -> None:
    m = SeqModule()
    t = rp_trainer(max_steps=4, async_step=True)
    t.fit(m, loader())
    t.save_checkpoint(tmp_path / "m.ckpt")
    plain = SeqModule.load_from_checkpoint(tmp_path / "m.ckpt", mode="plain")
    assert max_rel_err(params_of(plain), params_of(m)) == 0.0
    # and Lightning's default strategy resumes training from it
    plain_trainer(max_steps=6).fit(plain, loader(), ckpt_path=tmp_path / "m.ckpt")
    assert len(plain.losses) == 2


def test_plain_checkpoint_resumes_under_roundpipe(tmp_path: Path) -> None:
    """A checkpoint written by the default strategy (no masters) resumes under RoundPipe
    and continues exactly like the default strategy would."""
    ref = SeqModule(mode="plain")
    t = plain_trainer(max_steps=5)
    t.fit(ref, loader())
    t.save_checkpoint(tmp_path / "p.ckpt")
    cont_ref = SeqModule(mode="plain")
    plain_trainer(max_steps=10).fit(cont_ref, loader(), ckpt_path=tmp_path / "p.ckpt")
    cont_rp = SeqModule()
    rp_trainer(max_steps=10).fit(cont_rp, loader(), ckpt_path=tmp_path / "p.ckpt")
    assert max_rel_err(params_of(cont_rp), params_of(cont_ref)) <= 1e-5


def test_model_checkpoint_callback_and_validate_from_checkpoint(tmp_path: Path) -> None:
    m = SeqModule()
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1)
    t = rp_trainer(max_epochs=2, enable_checkpointing=True, callbacks=[cb], async_step=True)
    t.fit(m, loader(), loader())
    assert cb.best_model_path
    out = rp_trainer().validate(SeqModule(seed=5), loader(), ckpt_path=cb.best_model_path)
    assert out[0]["val_loss"] == pytest.approx(float(cb.best_model_score), rel=1e-5)


def test_resume_restores_loss_scaler_and_timer(tmp_path: Path) -> None:
    """16-mixed: the dynamic loss scale (backed off by early overflows) and the layer
    timer's measurements come back on resume; the run continues identically."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    def trainer(max_steps: int, callbacks: list) -> L.Trainer:
        from roundpipe_lightning import RoundPipeStrategy

        return L.Trainer(
            strategy=RoundPipeStrategy(num_microbatch=3, async_step=True),
            accelerator="cpu",
            devices=2,
            plugins=[MixedPrecision("16-mixed", "cpu")],
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            default_root_dir=tmp_path,  # the resumed run's default ModelCheckpoint saves here
        )

    seen = {}

    class Spy(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["scale"] = trainer.strategy._loss_scaler.scale
            seen["measured"] = pl_module.roundpipe.model_timer.has_measurements()

    a = SeqModule()
    trainer(5, [ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=5)]).fit(a, loader())
    a2 = SeqModule(seed=9)
    trainer(10, [Spy()]).fit(a2, loader(), ckpt_path=tmp_path / "a" / "epoch=0-step=5.ckpt")
    b = SeqModule()
    trainer(10, [ModelCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=5)]).fit(b, loader())
    assert seen["scale"] < 2.0**16 and seen["measured"]
    assert a.losses + a2.losses == b.losses
    assert max_rel_err(params_of(a2), params_of(b)) == 0.0


def test_mid_epoch_resume_is_as_exact_as_plain_lightnings(tmp_path: Path) -> None:
    """A checkpoint at step 3 of a 5-batch epoch: a plain DataLoader has no position to
    restore, so Lightning restarts the epoch and the resumed run differs from the straight
    one -- under the default strategy and RoundPipeStrategy alike, by the same amount."""

    def resumed(trainer, mode: str) -> dict:
        saver = ModelCheckpoint(dirpath=tmp_path / mode, every_n_train_steps=3, save_top_k=-1)
        first = trainer(max_steps=3, enable_checkpointing=True, callbacks=[saver])
        first.fit(SeqModule(mode=mode), loader())
        again = SeqModule(mode=mode, seed=5)  # everything comes from the file
        trainer(max_steps=8).fit(again, loader(), ckpt_path=tmp_path / mode / "epoch=0-step=3.ckpt")
        return params_of(again)

    plain = resumed(plain_trainer, "plain")
    ours = resumed(rp_trainer, "roundpipe")
    straight = SeqModule(mode="plain")
    plain_trainer(max_steps=8).fit(straight, loader())
    assert max_rel_err(ours, plain) <= 1e-5
    assert max_rel_err(plain, params_of(straight)) > 1e-2  # plain Lightning: not exact either
