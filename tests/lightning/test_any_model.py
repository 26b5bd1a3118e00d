"""configure_sequential() may return any module: one that is neither an nn.Sequential nor
a model that a preset or the converter by structure converts (a ResMLP with its residual
loop, a Hugging Face BloomForCausalLM, whose ALiBi bias the converter refuses) gets
the automatic split (AutoRoundPipe, as wrap_model_to_roundpipe(use_sequential_preset=False)
does), the run says so once, and it trains to plain Lightning's weights."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from rpl_helpers import max_rel_err, params_of, trainer_kwargs
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from roundpipe_core import AutoRoundPipe
from roundpipe_lightning import RoundPipeStrategy

TOL = 1e-5


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


class ResMLP(nn.Module):
    """Not an nn.Sequential: a loop over a ModuleList of residual blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def tiny_bloom() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BloomConfig(
        vocab_size=64,
        hidden_size=16,
        n_layer=2,
        n_head=2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        use_cache=False,
    )
    return transformers.BloomForCausalLM(cfg)


# (Mamba-2, whose mixer reads its conv1d weight itself, converts by structure now; the
# automatic split's handling of it is tested in tests/presets/test_autosplit_hf.py)
MAKERS = {"resmlp": (ResMLP, False), "bloom": (tiny_bloom, True)}


class AnyModel(L.LightningModule):
    """A Lightning module over ``make()``'s network: through ``self.roundpipe`` under the
    strategy, the network itself under the default strategy."""

    def __init__(self, make: Any, lm: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = make()
        self.lm = lm
        self.seen: type | None = None

    def configure_sequential(self) -> nn.Module:
        return self.net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        rp = getattr(self, "roundpipe", None)
        self.seen = type(rp)
        run = rp if rp is not None else self.net
        if self.lm:
            return run(input_ids=x, labels=x).loss
        return F.mse_loss(run(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data(lm: bool) -> DataLoader:
    g = torch.Generator().manual_seed(4)
    if lm:
        ids = torch.randint(2, 64, (24, 10), generator=g)
        return DataLoader(TensorDataset(ids, ids), batch_size=6)
    return DataLoader(
        TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 4, generator=g)), 6
    )


def _said(records: list[logging.LogRecord], caught: list[Any]) -> list[str]:
    texts = [r.getMessage() for r in records] + [str(w.message) for w in caught]
    return [t for t in texts if "splits it automatically" in t]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_any_module_gets_the_automatic_split(name: str, caplog: pytest.LogCaptureFixture) -> None:
    make, lm = MAKERS[name]
    ref = AnyModel(make, lm)
    L.Trainer(**trainer_kwargs(max_steps=3, devices=1)).fit(ref, _data(lm))
    got = AnyModel(make, lm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(**trainer_kwargs(max_steps=3, devices=2, strategy=RoundPipeStrategy()))
        trainer.fit(got, _data(lm))
    assert got.seen is AutoRoundPipe
    said = _said(caplog.records, caught)
    assert len(said) == 1, said
    assert "AutoRoundPipe" in said[0] and "register_preset" in said[0]
    assert "units run on the device pool (" in said[0]  # how many, how many pipelined
    assert max_rel_err(params_of(got), params_of(ref)) <= TOL
    assert max_rel_err(params_of(got), params_of(AnyModel(make, lm))) > 1e-3  # it trained


def test_an_execute_plan_for_an_automatic_split_is_refused() -> None:
    trainer = L.Trainer(
        **trainer_kwargs(max_steps=1, devices=2, strategy=RoundPipeStrategy(execute_plan="auto"))
    )
    with pytest.raises(ValueError, match="execute_plan.*AutoRoundPipe"):
        trainer.fit(AnyModel(ResMLP, False), _data(False))


def test_a_loss_reaching_a_units_parameter_outside_the_split_names_the_unit() -> None:
    from roundpipe_core.autosplit import auto_wrap
    from roundpipe_lightning.session import check_loss_went_through

    torch.manual_seed(0)
    net = ResMLP()
    rp = auto_wrap(net, split_threshold=300, devices=1)
    try:
        assert isinstance(rp, AutoRoundPipe)
        check_loss_went_through(rp(torch.randn(3, 8)).sum(), rp)  # through the split: fine
        with pytest.raises(RuntimeError, match=r"unit 'blocks.0.fc'.*built outside that call"):
            check_loss_went_through(net.blocks[0](torch.randn(3, 16)).sum(), rp)
    finally:
        rp.close()
