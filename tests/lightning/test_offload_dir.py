"""``offload_dir`` (the disk tier) through the Trainer and Fabric: the same weights, bit
for bit, as the same run in RAM (synchronous and asynchronous steps, accumulation,
clipping, an LR scheduler, bf16 and fp32 models); checkpoints of the same format, and a
run that resumes across tiers continues exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from rpl_helpers import SeqModule, build_net, loader, params_of, rp_trainer
from torch import nn

from roundpipe_lightning import RoundPipeFabricStrategy, RoundPipeStrategy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tier(tmp_path: Path) -> str:
    d = tmp_path / "tier"
    d.mkdir(exist_ok=True)
    return str(d)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())


def _fit(
    offload_dir: str | None,
    steps: int,
    module: dict | None = None,
    ckpt: Path | None = None,
    save_dir: Path | None = None,
    **kw: Any,
) -> SeqModule:
    """A Trainer run of ``steps`` (in RAM, or with the disk tier in ``offload_dir``);
    ``save_dir``: a checkpoint every 5 steps (an epoch); ``ckpt``: resumed from it (the
    module starts elsewhere: everything must come from the file)."""
    m = SeqModule(seed=123 if ckpt else 0, **(module or {}))
    callbacks = []
    if save_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, every_n_train_steps=5, save_top_k=-1))
    strategy_kw = {"offload_dir": offload_dir} if offload_dir else {}
    trainer = rp_trainer(
        max_steps=steps,
        enable_checkpointing=save_dir is not None,
        callbacks=callbacks,
        strategy_kw=strategy_kw,
        **kw,
    )
    trainer.fit(m, loader(), ckpt_path=ckpt)
    if offload_dir:
        assert not any(Path(offload_dir).iterdir())  # the store is removed at teardown
    return m


TRAINER_CASES = {
    "sync": dict(async_step=False),
    "async-overlapped": dict(async_step=True),
    "async-accumulate-clip-scheduler": dict(
        async_step=True,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        module=dict(scheduler=True),
    ),
    "sync-accumulate-clip-scheduler": dict(
        async_step=False,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        module=dict(scheduler=True, optimizer="sgd"),
    ),
    "bf16-true-async-scheduler": dict(
        async_step=True, precision="bf16-true", module=dict(scheduler=True)
    ),
    "bf16-true-sync-clip": dict(async_step=False, precision="bf16-true", gradient_clip_val=0.05),
}


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_trainer_weights_equal_the_run_in_ram(tmp_path: Path, name: str) -> None:
    case = dict(TRAINER_CASES[name])
    want = params_of(_fit(None, 6, **case))
    got = params_of(_fit(_tier(tmp_path), 6, **case))
    _assert_equal(got, want)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("direction", ["ram-to-tier", "tier-to-ram"])
def test_a_checkpoint_resumes_across_tiers_exactly(
    tmp_path: Path, direction: str, precision: str
) -> None:
    """5 steps and a checkpoint in one tier, resumed to 9 in the other: the weights of 9
    straight steps in RAM; and the checkpoint equals, tensor for tensor, the one the
    straight run wrote at step 5 (the same format whichever tier wrote it)."""
    first, then = (None, _tier(tmp_path)) if direction == "ram-to-tier" else (_tier(tmp_path), None)
    kw = dict(async_step=True, precision=precision, module=dict(scheduler=True))
    _fit(first, 5, save_dir=tmp_path / "a", **kw)
    ckpt = tmp_path / "a" / "epoch=0-step=5.ckpt"
    resumed = _fit(then, 9, ckpt=ckpt, **kw)
    straight = _fit(None, 9, save_dir=tmp_path / "b", **kw)
    _assert_equal(params_of(resumed), params_of(straight))

    a = torch.load(ckpt, weights_only=True)
    b = torch.load(tmp_path / "b" / "epoch=0-step=5.ckpt", weights_only=True)
    _assert_equal(a["state_dict"], b["state_dict"])
    masters = a["roundpipe"]["masters"]
    assert bool(masters) == (precision == "bf16-true")  # fp32 masters of a bf16 model only
    _assert_equal(masters, b["roundpipe"]["masters"])
    (sa,), (sb,) = a["optimizer_states"], b["optimizer_states"]
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for i, s in sb["state"].items():
        assert sa["state"][i].keys() == s.keys()
        for key, value in s.items():
            assert torch.equal(torch.as_tensor(sa["state"][i][key]), torch.as_tensor(value))


# -- Fabric ------------------------------------------------------------------------------------
def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g)) for _ in range(steps)
    ]


def _fabric_run(
    offload_dir: str | None,
    data: list,
    dtype: torch.dtype = torch.float32,
    clip: float | None = None,
    save: Path | None = None,
    load: Path | None = None,
    drain_after: int | None = None,
    **strategy_kw: Any,
) -> dict[str, torch.Tensor]:
    """Fabric's loop (AdamW, a StepLR) over ``data``: ``load`` first / ``save`` after it;
    ``drain_after``: ``synchronize()`` after that many steps (as a save there would:
    the next iteration then reads that step's weights, not the one-step-stale ones)."""
    if offload_dir:
        strategy_kw["offload_dir"] = offload_dir
    strategy = RoundPipeFabricStrategy(num_microbatch=3, **strategy_kw)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    net = build_net().to(dtype)
    if load is not None:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)  # another starting point: everything must come from the file
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    try:
        if load is not None:
            state = {"model": model, "optimizer": opt, "sched": sched}
            fabric.load(load, state)
        for i, (x, y) in enumerate(data):
            if i == drain_after:
                model.synchronize()
            opt.zero_grad()
            model.forward_backward(input_args=(x.to(dtype),), label=y.to(dtype), loss_fn=F.mse_loss)
            if clip is not None:
                fabric.clip_gradients(model, opt, max_norm=clip)
            opt.step()
            sched.step()
        if save is not None:
            fabric.save(save, {"model": model, "optimizer": opt, "sched": sched})
        model.synchronize()
        return {k: v.clone() for k, v in net.state_dict().items()}
    finally:
        strategy.teardown()


@pytest.mark.parametrize(
    "kw",
    [
        dict(async_step=False),
        dict(async_step=True, clip=0.05),
        dict(async_step=True, dtype=torch.bfloat16),
        dict(async_step=False, dtype=torch.bfloat16, clip=0.05),
    ],
    ids=["sync", "async-clip", "bf16-async", "bf16-sync-clip"],
)
def test_fabric_weights_equal_the_run_in_ram(tmp_path: Path, kw: dict) -> None:
    data = _data(4)
    _assert_equal(_fabric_run(_tier(tmp_path), data, **kw), _fabric_run(None, data, **kw))


@pytest.mark.parametrize("direction", ["ram-to-tier", "tier-to-ram"])
def test_fabric_checkpoint_resumes_across_tiers_exactly(tmp_path: Path, direction: str) -> None:
    data = _data(5)
    kw: dict[str, Any] = dict(async_step=True, dtype=torch.bfloat16)
    first, then = (None, _tier(tmp_path)) if direction == "ram-to-tier" else (_tier(tmp_path), None)
    path = tmp_path / "ckpt.pt"
    _fabric_run(first, data[:2], save=path, **kw)
    got = _fabric_run(then, data[2:], load=path, **kw)
    _assert_equal(got, _fabric_run(None, data, drain_after=2, **kw))


# -- what it refuses ---------------------------------------------------------------------------
def test_the_strategy_refuses_what_the_tier_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="offload_dir must be a directory path"):
        RoundPipeStrategy(offload_dir=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shard_host_state"):
        RoundPipeStrategy(offload_dir=_tier(tmp_path), shard_host_state=True)
    with pytest.raises(ValueError, match="is not a directory"):
        _fit(str(tmp_path / "missing"), 1)


class _TwoOptimizers(SeqModule):
    def __init__(self) -> None:
        super().__init__(manual=True)

    def configure_optimizers(self) -> Any:
        half = len(self.net) // 2
        return [
            torch.optim.SGD(self.net[:half].parameters(), lr=0.1),
            torch.optim.SGD(self.net[half:].parameters(), lr=0.1),
        ]


class _CoupledAdam(torch.optim.Adam):
    def step(self, closure: Any = None) -> Any:  # (a step that may couple parameters)
        return super().step(closure)


class _Coupled(SeqModule):
    def configure_optimizers(self) -> Any:
        return _CoupledAdam(self.parameters(), lr=0.1)


class _NotSequential(SeqModule):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Module()
        self.block.net = self.net

        def forward(x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        self.block.forward = forward  # type: ignore[method-assign]

    def configure_sequential(self) -> nn.Module:
        return self.block


@pytest.mark.parametrize(
    "module, match",
    [
        (_TwoOptimizers, "one optimizer"),
        (_Coupled, "steps_elementwise is False"),
        (_NotSequential, "needs an nn.Sequential"),
    ],
    ids=["two-optimizers", "coupled-optimizer", "not-sequential"],
)
def test_a_run_the_tier_cannot_stream_is_refused_at_setup(
    tmp_path: Path, module: type, match: str
) -> None:
    trainer = rp_trainer(max_steps=1, strategy_kw={"offload_dir": _tier(tmp_path)})
    with pytest.raises(ValueError, match=match):
        trainer.fit(module(), loader())


def test_several_processes_are_refused(tmp_path: Path) -> None:
    """(The weight broadcast and the reducers of several processes need resident masters;
    both strategies call this check where they learn the process count.)"""
    for strategy in (RoundPipeStrategy, RoundPipeFabricStrategy):
        settings = strategy(offload_dir=_tier(tmp_path)).settings
        settings.check_processes(1)
        with pytest.raises(ValueError, match="runs in one process"):
            settings.check_processes(2)
