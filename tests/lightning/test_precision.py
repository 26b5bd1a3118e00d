"""Precision modes: half-precision weights with fp32 masters, autocast on the workers,
dynamic loss scaling that skips overflowing steps."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from rpl_helpers import SeqModule, loader, max_rel_err, params_of, plain_trainer, rp_trainer
from torch import nn

from roundpipe_core.amp import GradScaler
from roundpipe_lightning.precision import AmpLossScaler, DynamicLossScaler, RoundPipePrecision


class Capture(L.Callback):
    """Keeps the strategy's RoundPipe and master params at the end of training."""

    def on_train_end(self, trainer, pl_module) -> None:
        rp = pl_module.roundpipe
        self.masters = [m.detach().clone() for m in rp.optim_parameters()]
        self.scaler = trainer.strategy._loss_scaler


@pytest.mark.parametrize(
    "precision, dtype", [("bf16-true", torch.bfloat16), ("16-true", torch.float16)]
)
def test_half_true_keeps_fp32_masters(precision: str, dtype: torch.dtype) -> None:
    cap = Capture()
    m = SeqModule(lr=3e-3)
    rp_trainer(max_steps=10, precision=precision, callbacks=[cap]).fit(m, loader())
    assert all(p.dtype == dtype for p in m.parameters())
    assert all(x.dtype == torch.float32 for x in cap.masters)
    # the masters keep precision the half weights cannot hold
    assert any(not torch.equal(x, x.to(dtype).float()) for x in cap.masters)
    for p, x in zip(m.parameters(), cap.masters):
        assert torch.equal(p, x.to(dtype))
    # it trains: the fp32 run reaches about the same weights
    ref = SeqModule(lr=3e-3)
    rp_trainer(max_steps=10).fit(ref, loader())
    assert max_rel_err(params_of(m), params_of(ref)) < 5e-2
    assert m.losses[-1] < m.losses[0]


SEEN_DTYPES: list[torch.dtype] = []


class DtypeProbe(nn.Module):
    """Identity that records the dtype its input arrives in (a Linear's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN_DTYPES.append(x.dtype)
        return x


class ProbedModule(SeqModule):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.net.insert(1, DtypeProbe())


def test_bf16_mixed_runs_layers_under_autocast_on_workers() -> None:
    SEEN_DTYPES.clear()
    m = ProbedModule()
    rp_trainer(max_steps=4, precision="bf16-mixed").fit(m, loader())
    assert SEEN_DTYPES and set(SEEN_DTYPES) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in m.parameters())
    # same autocast recipe as Lightning's default strategy
    ref = ProbedModule(mode="plain")
    plain_trainer(max_steps=4, precision="bf16-mixed").fit(ref, loader())
    assert max_rel_err(params_of(m), params_of(ref)) < 1e-2
    # after fit the hooks are gone: the module runs in fp32 again
    SEEN_DTYPES.clear()
    m.net(torch.randn(2, 8))
    assert SEEN_DTYPES == [torch.float32]


def _mixed16(init_scale: float = 2.0**16) -> MixedPrecision:
    # Lightning turns precision="16-mixed" into bf16-mixed on CPU; the plugin keeps fp16 + scaler.
    return MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale)
    )


def test_16_mixed_scales_losses_and_matches_lightning() -> None:
    SEEN_DTYPES.clear()
    cap = Capture()
    m = ProbedModule()
    rp_trainer(
        async_step=False,
        plugins=[_mixed16()],
        max_steps=4,
        callbacks=[cap],
    ).fit(m, loader())
    assert set(SEEN_DTYPES) == {torch.float16}
    ref = ProbedModule(mode="plain")
    ref_trainer = plain_trainer(plugins=[_mixed16()], max_steps=4)
    ref_trainer.fit(ref, loader())
    # at 2**16 the fp16 activation gradients overflow at first: both runs skip and back off alike
    assert cap.scaler.scale == ref_trainer.precision_plugin.scaler.get_scale() < 2.0**16
    assert cap.scaler.skipped_steps >= 1
    # the loss scale is roundpipe_core's thread-safe GradScaler, not a second implementation
    assert isinstance(cap.scaler, AmpLossScaler) and isinstance(cap.scaler.grad_scaler, GradScaler)
    assert max_rel_err(params_of(m), params_of(ref)) < 1e-2
    # the user sees the unscaled loss
    assert m.losses == pytest.approx(ref.losses, rel=1e-2)


class StepRecorder(L.Callback):
    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.strategy.roundpipe.synchronize()
        self.params.append(params_of(pl_module))


def test_16_mixed_skips_overflowing_step() -> None:
    dl = loader()
    dl.dataset.tensors[1][12:18] = 1e30  # batch 2: the loss overflows fp32 -> inf gradients
    rec, cap = StepRecorder(), Capture()
    m = SeqModule()
    rp_trainer(
        async_step=True,
        plugins=[_mixed16(init_scale=256.0)],
        max_steps=5,
        callbacks=[rec, cap],
    ).fit(m, dl)
    assert cap.scaler.skipped_steps == 1
    assert cap.scaler.scale == 128.0
    # step 3 (batch 2) changed nothing; the others did
    assert max_rel_err(rec.params[2], rec.params[1]) == 0.0
    assert max_rel_err(rec.params[3], rec.params[2]) > 0.0
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_strategy_runs_its_own_precision_plugin() -> None:
    t = rp_trainer(max_steps=1, precision="bf16-mixed")
    t.fit(SeqModule(), loader())
    plugin = t.precision_plugin
    assert isinstance(plugin, RoundPipePrecision) and plugin.precision == "bf16-mixed"
    assert plugin.scaler is None and t.precision == "bf16-mixed"


def test_a_given_roundpipe_precision_and_scaler_are_used() -> None:
    scaler = DynamicLossScaler(init_scale=256.0, growth_interval=2)
    cap = Capture()
    rp_trainer(
        async_step=False,
        plugins=[RoundPipePrecision("16-mixed", scaler=scaler)],
        max_steps=4,
        callbacks=[cap],
    ).fit(SeqModule(), loader())
    assert cap.scaler is scaler
    assert scaler.scale == 256.0 * 2**2  # four clean steps, growth every two


def test_precision_plugin_arguments() -> None:
    with pytest.raises(ValueError, match="'64-true'"):
        RoundPipePrecision("64-true")
    with pytest.raises(ValueError, match="only used with precision='16-mixed'"):
        RoundPipePrecision("bf16-mixed", scaler=DynamicLossScaler())
    with pytest.raises(TypeError, match="LossScaler"):
        RoundPipePrecision("16-mixed", scaler=object())  # type: ignore[arg-type]


def test_a_given_grad_scaler_is_the_one_used() -> None:
    gs = GradScaler(init_scale=256.0, growth_interval=2)
    cap = Capture()
    rp_trainer(
        max_steps=4,
        num_microbatch=3,
        async_step=True,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=gs)],  # type: ignore[arg-type]
        callbacks=[cap],
    ).fit(SeqModule(), loader())
    assert cap.scaler.grad_scaler is gs
    assert gs.get_scale() == 256.0 * 2**2  # four clean steps, growth every two
    assert RoundPipePrecision("16-mixed", scaler=gs).scaler.grad_scaler is gs  # type: ignore[union-attr]


def test_loss_scaler_state_round_trips_and_reads_the_earlier_format() -> None:
    a = AmpLossScaler(init_scale=64.0, growth_interval=3)
    p = nn.Parameter(torch.ones(3))
    for g in (1.0, float("inf"), 1.0):
        p.grad = torch.full((3,), g)
        a.update(a.unscale_([p]))
    state = a.state_dict()
    assert state["scale"] == 32.0 and state["_growth_tracker"] == 1 and state["skipped_steps"] == 1
    b = AmpLossScaler()
    b.load_state_dict(state)
    assert b.state_dict() == state
    # torch's own GradScaler reads it (same keys)
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(state)
    assert t.get_scale() == 32.0
    # a checkpoint of the scaler the strategy had before (growth_tracker without underscore)
    old = {
        "scale": 128.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 4,
        "growth_tracker": 3,
        "skipped_steps": 2,
    }
    c = AmpLossScaler()
    c.load_state_dict(old)
    assert c.scale == 128.0 and c.skipped_steps == 2
    assert c.grad_scaler.get_growth_interval() == 4
    p.grad = torch.ones(3)
    c.update(c.unscale_([p]))  # the fourth clean step in a row: the scale grows
    assert c.scale == 256.0


class _Scales(L.Callback):
    """The loss scale each step starts with."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        scaler = getattr(trainer.strategy, "_loss_scaler", None)
        if scaler is None:  # Lightning's default strategy: its plugin's GradScaler
            scaler = trainer.precision_plugin.scaler
        self.scales.append(float(scaler.get_scale()))


def _fp16_scales(mode: str, num_microbatch: int = 1) -> list[float]:
    plugin = MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1)
    )
    rec = _Scales()
    trainer = plain_trainer if mode == "plain" else rp_trainer
    kw = {} if mode == "plain" else {"num_microbatch": num_microbatch}
    trainer(max_steps=15, plugins=[plugin], callbacks=[rec], **kw).fit(
        SeqModule(mode=mode, lr=1e-3), loader(n=90)
    )
    return rec.scales


def test_one_microbatch_backs_off_at_plain_lightnings_steps() -> None:
    """With one microbatch the fp16 backward is the whole batch's, as in plain Lightning:
    the same overflows, so the same scale at every step. (With several microbatches each
    computes its own fp16 gradients and the back-offs may fall on other steps; the
    numerical contract page says so.)"""
    plain = _fp16_scales("plain")
    assert len(set(plain)) > 3  # it backed off and grew
    assert _fp16_scales("roundpipe", num_microbatch=1) == plain
