"""RoundPipeStrategy(async_step=False) keeps one copy of an fp32 model's weights: the
parameters are the optimizer's masters. Same numbers as Lightning's default
strategy; checkpoints hold each tensor once and resume exactly."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rpl_helpers import (
    SeqModule,
    loader,
    max_rel_err,
    params_of,
    plain_trainer,
    rp_trainer,
    trainer_kwargs,
)

TOL = 1e-5


class _Sharing(L.Callback):
    """Records, once training starts, how the masters relate to the module's parameters."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rp = pl_module.roundpipe
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        opt_params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
        self.seen = {
            "shared": rp.masters.num_shared,
            "trainable": len(trainable),
            "masters_are_params": all(rp.master_param(p) is p for p in trainable),
            "optimizer_holds_params": [id(p) for p in opt_params] == [id(p) for p in trainable],
            "copies": len(rp.masters.copies),
        }


def test_sync_step_shares_masters_and_matches_default_strategy() -> None:
    ref = SeqModule(mode="plain")
    plain_trainer(max_steps=6).fit(ref, loader())
    m, cb = SeqModule(), _Sharing()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rp_trainer(max_steps=6, async_step=False, callbacks=[cb]).fit(m, loader())
    s = cb.seen
    assert s["shared"] == s["trainable"] > 0 and s["copies"] == 0
    assert s["masters_are_params"] and s["optimizer_holds_params"]
    # the optimizer holds the module's parameters: not mistaken for "none of the network's"
    assert not [w for w in caught if "holds none of the parameters" in str(w.message)]
    assert not [w for w in caught if "shared_masters" in str(w.message)]
    assert max_rel_err(params_of(m), params_of(ref)) <= TOL
    assert m.losses == pytest.approx(ref.losses, rel=1e-5)


@pytest.mark.parametrize(
    ("async_step", "precision"),
    [(True, "32-true"), (False, "bf16-true")],
    ids=["async_fp32", "sync_bf16"],
)
def test_no_sharing_with_async_step_or_half_precision(async_step: bool, precision: str) -> None:
    m, cb = SeqModule(), _Sharing()
    rp_trainer(max_steps=2, async_step=async_step, precision=precision, callbacks=[cb]).fit(
        m, loader()
    )
    assert cb.seen["shared"] == 0 and cb.seen["copies"] == cb.seen["trainable"]
    assert not cb.seen["masters_are_params"]


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def test_checkpoint_stores_each_tensor_once_and_resumes_exactly(tmp_path: Path) -> None:
    wide = 1024  # the two wide layers dominate the file: a second copy would show
    a = SeqModule(wide=wide)
    # saved where ModelCheckpoint saves (step 5 ends an epoch: the resumed run sees the
    # same batches as the straight one)
    save = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    rp_trainer(max_steps=5, async_step=False, enable_checkpointing=True, callbacks=[save]).fit(
        a, loader()
    )
    path = tmp_path / "epoch=0-step=5.ckpt"

    ck = torch.load(path, weights_only=True)  # a plain torch.load reads it
    assert ck["roundpipe"]["masters"] == {}  # fp32: the masters are the weights
    weights = _tensor_bytes(ck["state_dict"])
    state = ck["optimizer_states"][0]["state"]
    assert len(state) == len(list(a.parameters()))
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    tensors = weights + _tensor_bytes(state)
    size = path.stat().st_size
    # weights + AdamW state, plus the archive's per-record overhead; not the weights twice
    assert tensors < size < tensors + weights // 4, (size, tensors, weights)

    loaded = SeqModule.load_from_checkpoint(path)
    assert max_rel_err(params_of(loaded), params_of(a)) == 0.0

    # resume from step 5 to 10 == 10 steps straight
    b = SeqModule(wide=wide, seed=7)  # a different init: all must come from the file
    cb = _Sharing()
    rp_trainer(max_steps=10, async_step=False, callbacks=[cb]).fit(b, loader(), ckpt_path=path)
    assert cb.seen["shared"] == cb.seen["trainable"]
    straight = SeqModule(wide=wide)
    rp_trainer(max_steps=10, async_step=False).fit(straight, loader())
    assert a.losses + b.losses == straight.losses
    pb, ps = params_of(b), params_of(straight)
    for k in pb:
        assert torch.equal(pb[k], ps[k]), k


def test_the_default_step_follows_the_hardware() -> None:
    """async_step=None: synchronous with shared masters on CPU workers (plain Lightning's
    numbers); a GPU pool would overlap the step; an explicit choice wins."""
    from roundpipe_lightning import RoundPipeStrategy

    ref = SeqModule(mode="plain")
    plain_trainer(max_steps=6).fit(ref, loader())
    m, cb = SeqModule(), _Sharing()
    trainer = L.Trainer(
        **trainer_kwargs(
            strategy=RoundPipeStrategy(num_microbatch=3), devices=2, max_steps=6, callbacks=[cb]
        )
    )
    trainer.fit(m, loader())
    assert trainer.strategy.async_step is False  # type: ignore[attr-defined]
    assert cb.seen["shared"] == cb.seen["trainable"] > 0  # one copy of the weights
    assert max_rel_err(params_of(m), params_of(ref)) <= TOL  # not one step stale

    gpus = RoundPipeStrategy(parallel_devices=[torch.device("cuda", 0)])
    assert gpus.async_step is True  # the step runs beside the devices there
    explicit = RoundPipeStrategy(async_step=True)
    assert explicit.async_step is True
    assert (
        RoundPipeStrategy(async_step=False, parallel_devices=gpus.parallel_devices).async_step
        is False
    )
    with pytest.raises(TypeError, match="async_step"):
        RoundPipeStrategy(async_step="no")  # type: ignore[arg-type]
