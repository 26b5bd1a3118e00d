"""Bad configurations fail at setup with messages that say what to fix; failures
during fit surface as the exception and leave no RoundPipe thread running."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from rpl_helpers import (
    FailsAtThirdStep,
    SeqModule,
    loader,
    plain_trainer,
    roundpipe_threads,
    rp_trainer,
)
from torch import nn

from roundpipe_lightning import AutoReplan, RoundPipeStrategy, StageTimeLogger


class NoHook(SeqModule):
    configure_sequential = None  # type: ignore[assignment]


def test_missing_configure_sequential() -> None:
    with pytest.raises(TypeError, match=r"configure_sequential\(\).*nn.Sequential"):
        rp_trainer(max_steps=1).fit(NoHook(), loader())
    assert roundpipe_threads() == []


class ReturnsTensor(SeqModule):
    def configure_sequential(self):
        return torch.zeros(3)


class ReturnsDetached(SeqModule):
    def configure_sequential(self):
        return nn.Sequential(nn.Linear(8, 4))  # not an attribute: not in the state_dict


class ReturnsSelf(SeqModule):
    def configure_sequential(self):
        return self


class ReturnsEmpty(SeqModule):
    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Sequential()

    def configure_sequential(self):
        return self.empty


@pytest.mark.parametrize(
    "cls, exc, pattern",
    [
        (ReturnsTensor, TypeError, "must return an nn.Module"),
        (ReturnsDetached, ValueError, "submodule of the LightningModule"),
        (ReturnsSelf, ValueError, "LightningModule itself"),
        (ReturnsEmpty, ValueError, "empty nn.Sequential"),
    ],
)
def test_unusable_configure_sequential(cls, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        rp_trainer(max_steps=1).fit(cls(), loader())
    assert roundpipe_threads() == []


@pytest.mark.parametrize(
    "layout, pattern",
    [
        ("fwd=3,x bwd=2,2,2,1", "x"),
        ("fwd=3,2 bwd=2,2,2", "cover"),
        ("fwd=3,2 bwd=0:2,1:2,2:2,0:1", "device 2"),
        ("stages=3,4", "stages=3,4"),
    ],
)
def test_bad_layout_string(layout: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        rp_trainer(max_steps=1, strategy_kw=dict(execute_plan=layout)).fit(SeqModule(), loader())
    assert "7 layers" in str(info.value) and "2 device" in str(info.value)
    assert str(info.value).startswith(f"RoundPipeStrategy(execute_plan={layout!r})")
    assert roundpipe_threads() == []


def test_unsupported_precision() -> None:
    with pytest.raises(ValueError, match=r"does not support.*'bf16-true'"):
        rp_trainer(max_steps=1, precision="64-true").fit(SeqModule(), loader())
    assert roundpipe_threads() == []


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(loss_reduction="avg"), ValueError, "loss_reduction='avg'"),
        (dict(loss_reduction=None), ValueError, "loss_reduction=None"),
        (dict(loss_reduction=1), TypeError, "loss_reduction=1"),
        (dict(num_microbatch=0), ValueError, "num_microbatch=0"),
        (dict(num_microbatch="3"), TypeError, "num_microbatch='3'"),
        (dict(num_microbatch=True), TypeError, "num_microbatch=True"),
        (dict(recompute_grain="block"), ValueError, "recompute_grain='block'"),
        (dict(pin_model="yes"), ValueError, "pin_model='yes'"),
        (dict(pin_model=1), TypeError, "pin_model=1"),
        (dict(optim_dtype="float8"), ValueError, "optim_dtype='float8'"),
        (dict(execute_plan=3), TypeError, "execute_plan"),
        (dict(model_run_config={"num_microbatch": 2}), TypeError, "model_run_config"),
        # strings that bool() would turn into True
        (dict(async_step="False"), TypeError, "async_step='False'.*true / false"),
        (dict(preserve_rng_state="false"), TypeError, "preserve_rng_state='false'"),
        (dict(overlap_grad_reduce=0), TypeError, "overlap_grad_reduce=0"),
        (dict(grad_reduce_op="avg"), ValueError, "grad_reduce_op='avg'"),
        (dict(process_group_timeout=float("inf")), ValueError, "timeout=inf"),
        (dict(process_group_timeout=float("nan")), ValueError, "timeout=nan"),
        (dict(process_group_timeout=-5), ValueError, "positive, finite"),
        (dict(process_group_timeout="30"), TypeError, "timeout must be seconds"),
    ],
)
def test_bad_strategy_arguments(kwargs, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        RoundPipeStrategy(**kwargs)


def test_optim_dtype_names() -> None:
    assert RoundPipeStrategy(optim_dtype="torch.bfloat16").optim_dtype == torch.bfloat16
    assert RoundPipeStrategy(optim_dtype="float32").optim_dtype == torch.float32
    assert RoundPipeStrategy(optim_dtype=None).optim_dtype is None


class WithLBFGS(SeqModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_lbfgs_is_rejected() -> None:
    with pytest.raises(TypeError, match="LBFGS"):
        rp_trainer(max_steps=1).fit(WithLBFGS(), loader())
    assert roundpipe_threads() == []


class Exploding(nn.Module):
    """Raises on a NaN input (batch 2 of the test data has one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.isnan(x).any():
            raise FloatingPointError("NaN reached the exploding layer")
        return x


class ExplodingModule(SeqModule):
    def __init__(self) -> None:
        super().__init__()
        self.net.insert(2, Exploding())


def _nan_loader():
    dl = loader()
    x, y = dl.dataset.tensors
    x[13, 0] = float("nan")  # batch 2
    return dl


@pytest.mark.parametrize("async_step", [False, True])
def test_worker_exception_surfaces_and_stops_threads(async_step: bool) -> None:
    m = ExplodingModule()
    with pytest.raises(FloatingPointError, match="NaN reached"):
        rp_trainer(max_steps=5, async_step=async_step).fit(m, _nan_loader())
    assert len(m.losses) == 2
    assert roundpipe_threads() == []
    assert "roundpipe" not in vars(m)
    # the same module trains again afterwards
    rp_trainer(max_steps=2, async_step=async_step).fit(m, loader())
    assert roundpipe_threads() == []


@pytest.mark.parametrize("async_step", [False, True])
def test_optimizer_thread_exception_surfaces(async_step: bool) -> None:
    with pytest.raises(RuntimeError, match="optimizer blew up"):
        rp_trainer(max_steps=6, async_step=async_step).fit(FailsAtThirdStep(), loader())
    assert roundpipe_threads() == []


@pytest.mark.parametrize("cb", [AutoReplan(warmup_steps=1), StageTimeLogger(every_n_steps=1)])
def test_callbacks_need_the_strategy(cb: L.Callback) -> None:
    with pytest.raises(TypeError, match="RoundPipeStrategy"):
        plain_trainer(max_steps=1, callbacks=[cb]).fit(SeqModule(mode="plain"), loader())


def test_callback_arguments() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        AutoReplan(warmup_steps=0)
    with pytest.raises(ValueError, match="run_type"):
        AutoReplan(run_type="sideways")
    with pytest.raises(ValueError, match="every_n_steps"):
        StageTimeLogger(every_n_steps=0)


def test_multi_node_is_refused_clearly() -> None:
    t = L.Trainer(
        strategy=RoundPipeStrategy(),
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match="num_nodes"):
        t.fit(SeqModule(), loader())
    assert roundpipe_threads() == []


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without GPUs"
)
def test_gpu_devices_without_gpus_fail_before_training() -> None:
    with pytest.raises(Exception, match="(?i)gpu|cuda"):
        L.Trainer(strategy=RoundPipeStrategy(), accelerator="gpu", devices=2)


class CallsNetDirectly(SeqModule):
    """The first thing a Hugging Face user writes: the network, not self.roundpipe."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.net(x), y)
        if not self.automatic_optimization:
            self.manual_backward(loss)
            return None
        return loss


@pytest.mark.parametrize("manual", [False, True])
def test_calling_the_network_directly_names_self_roundpipe(manual: bool) -> None:
    m = CallsNetDirectly(manual=manual)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(RuntimeError, match=r"self\.roundpipe\.forward_backward"):
        rp_trainer(max_steps=2).fit(m, loader())
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    assert roundpipe_threads() == []
