"""The strategy as a Lightning user meets it: devices, self.roundpipe, layouts,
validate/test/predict with torchmetrics, fit twice, the registered name, presets."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from rpl_helpers import (
    SeqModule,
    TinyLM,
    loader,
    max_rel_err,
    params_of,
    plain_trainer,
    roundpipe_threads,
    rp_trainer,
    token_loader,
    trainer_kwargs,
)

from roundpipe_core import RoundPipe
from roundpipe_lightning import RoundPipeStrategy


class Probe(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rp = pl_module.roundpipe
        self.rp = rp
        self.num_devices = rp.num_devices
        self.kinds = [w.device.type for w in rp.pool.workers]
        self.submodules = [n for n, _ in pl_module.named_children()]


@pytest.mark.parametrize("devices", [1, 3])
def test_devices_are_cpu_workers_in_one_process(devices: int) -> None:
    probe = Probe()
    t = rp_trainer(devices=devices, max_steps=2, callbacks=[probe])
    assert t.num_devices == devices and t.world_size == 1
    m = SeqModule()
    t.fit(m, loader())
    assert probe.num_devices == devices and probe.kinds == ["cpu"] * devices
    assert probe.submodules == ["net"]  # self.roundpipe is not registered as a submodule
    # the engine's own class, composed (not subclassed) by the strategy
    assert probe.rp.model is m.net and type(probe.rp) is RoundPipe
    assert "roundpipe" not in vars(m)  # removed at teardown
    assert roundpipe_threads() == []


def test_registered_strategy_name() -> None:
    probe = Probe()
    t = L.Trainer(**trainer_kwargs(strategy="roundpipe", devices=2, max_steps=1, callbacks=[probe]))
    assert isinstance(t.strategy, RoundPipeStrategy)
    t.fit(SeqModule(), loader())
    assert probe.num_devices == 2


@pytest.mark.parametrize(
    "layout",
    ["fwd=3,2 bwd=2,2,2,1", "fwd=0:3,0:2 bwd=1:2,0:2,1:2,0:1", {"fwd": "2,2,1", "bwd": "2,5"}],
    ids=["counts", "owners", "dict"],
)
def test_layout_plans_train_identically(layout) -> None:
    probe = Probe()
    m = SeqModule()
    rp_trainer(max_steps=4, callbacks=[probe], strategy_kw=dict(execute_plan=layout)).fit(
        m, loader()
    )
    plan = probe.rp.plan_for("fused")
    jobs = probe.rp.last_call.schedule
    assert [j.layers for j in jobs if j.kind != "forward"] == plan.bwd_plan
    assert [j.layers for j in jobs if j.kind == "forward"] == plan.fwd_plan
    if layout == "fwd=0:3,0:2 bwd=1:2,0:2,1:2,0:1":
        assert [j.device for j in jobs] == [0, 0, 1, 0, 1, 0]
    ref = SeqModule(mode="plain")
    plain_trainer(max_steps=4).fit(ref, loader())
    assert max_rel_err(params_of(m), params_of(ref)) <= 1e-5


def test_recompute_grain_layer_and_more_microbatches() -> None:
    m = SeqModule(mode="rp_forward")
    rp_trainer(max_steps=3, num_microbatch=5, strategy_kw=dict(recompute_grain="layer")).fit(
        m, loader()
    )
    ref = SeqModule(mode="plain")
    plain_trainer(max_steps=3).fit(ref, loader())
    assert max_rel_err(params_of(m), params_of(ref)) <= 1e-5


def test_validate_test_predict_with_torchmetrics() -> None:
    m, ref = TinyLM(), TinyLM(mode="plain")
    rp_trainer(max_steps=4, async_step=True).fit(m, token_loader())
    ref.load_state_dict(m.state_dict())
    got = rp_trainer().validate(m, token_loader())[0]
    want = plain_trainer().validate(ref, token_loader())[0]
    assert got["val_acc"] == pytest.approx(want["val_acc"], abs=1e-6)
    assert got["val_ce"] == pytest.approx(want["val_ce"], rel=1e-5)
    got_t = rp_trainer().test(m, token_loader())[0]
    assert got_t["val_ce"] == pytest.approx(want["val_ce"], rel=1e-5)
    preds = rp_trainer().predict(m, token_loader())
    want_p = plain_trainer().predict(ref, token_loader())
    assert len(preds) == len(want_p) == 5
    for a, b in zip(preds, want_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert roundpipe_threads() == []


def test_fit_twice_in_one_process() -> None:
    m = SeqModule()
    t = rp_trainer(max_epochs=1, async_step=True)
    t.fit(m, loader())
    after_first = params_of(m)
    assert roundpipe_threads() == []
    t.fit_loop.max_epochs = 2
    t.fit(m, loader())  # same Trainer, same strategy object: a new RoundPipe on the same module
    assert len(m.losses) == 10
    assert max_rel_err(params_of(m), after_first) > 0
    rp_trainer(max_steps=3).fit(m, loader())  # and a fresh Trainer
    assert len(m.losses) == 13
    assert roundpipe_threads() == []


def test_validation_during_fit_sees_current_weights() -> None:
    """With async_step the pending update is applied before validation runs."""
    m = SeqModule()
    t = rp_trainer(max_steps=5, async_step=True, val_check_interval=5, limit_val_batches=1)
    t.fit(m, loader(), loader())
    x, y = next(iter(loader()))
    with torch.no_grad():
        expected = float(m.loss_fn(m.net(x), y))
    assert m.val_losses[-1] == pytest.approx(expected, rel=1e-6)


def test_hugging_face_model_through_preset() -> None:
    """configure_sequential() may return a Hugging Face causal LM that a preset converts;
    state-dict names stay the HF model's."""
    transformers = pytest.importorskip("transformers")
    from roundpipe_core.presets import causal_lm_loss_fn

    class HFLit(L.LightningModule):
        def __init__(self, roundpipe: bool = True) -> None:
            super().__init__()
            torch.manual_seed(0)
            cfg = transformers.LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=64,
                max_position_embeddings=32,
                use_cache=False,
            )
            self.lm = transformers.LlamaForCausalLM(cfg)
            self.use_rp = roundpipe

        def configure_sequential(self):
            return self.lm

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            if not self.use_rp:
                return self.lm(input_ids=ids, labels=ids).loss
            return self.roundpipe.forward_backward(
                input_kwargs={"input_ids": ids}, label=ids, loss_fn=causal_lm_loss_fn(ids)
            )

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, 64, (12, 10), generator=torch.Generator().manual_seed(3))
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=6)
    m, ref = HFLit(), HFLit(roundpipe=False)
    probe = Probe()
    rp_trainer(max_steps=2, callbacks=[probe]).fit(m, dl)
    plain_trainer(max_steps=2).fit(ref, dl)
    assert probe.rp.num_layers == 2 + 2  # input adapter, 2 blocks, output adapter
    assert probe.rp.config is m.lm.config  # attribute fall-through to the HF model
    assert list(m.state_dict()) == list(ref.state_dict())
    assert max_rel_err(params_of(m), params_of(ref)) <= 1e-5


class DeclaresAttribute(SeqModule):
    def __init__(self) -> None:
        super().__init__()
        self.roundpipe = None  # declared for readers / type checkers


def test_declared_roundpipe_attribute_is_restored() -> None:
    probe = Probe()
    m = DeclaresAttribute()
    rp_trainer(max_steps=1, callbacks=[probe]).fit(m, loader())
    assert probe.rp is not None
    assert m.roundpipe is None
