"""A LightningModule written as for plain Lightning -- a batch-mean loss_fn, no
``reduction="sum"`` / n -- trains under RoundPipeStrategy to plain Lightning's weights
(``loss_reduction="mean"``, the default), also for uneven microbatches; ``"sum"`` is the
published contract, one argument away."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from rpl_helpers import max_rel_err, params_of, trainer_kwargs
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from roundpipe_lightning import RoundPipeStrategy

TOL = 1e-5
BATCH = 10  # over 3 microbatches 4/3/3, over 4 3/3/2/2


class Classifier(L.LightningModule):
    """What a Lightning user writes; ``plain`` trains ``self.net`` under the default strategy."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.plain = plain
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)
        )
        self.losses: list[float] = []

    def configure_sequential(self) -> nn.Module:
        return self.net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.plain:
            loss = F.cross_entropy(self.net(x), y)
        else:
            loss = self.roundpipe.forward_backward(
                input_args=(x,), label=y, loss_fn=F.cross_entropy
            )
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        # momentum: not invariant to the gradient's scale, so a factor of num_microbatch shows
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * BATCH, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 5, (4 * BATCH,), generator=g)), BATCH)


def _fit(module: L.LightningModule, **kw: Any) -> L.LightningModule:
    L.Trainer(**trainer_kwargs(max_steps=4, **kw)).fit(module, _loader())
    return module


def _plain() -> Classifier:
    return _fit(Classifier(plain=True), devices=1)


@pytest.mark.parametrize("num_microbatch", [3, 4])
def test_mean_loss_matches_plain_lightning(num_microbatch: int) -> None:
    ref = _plain()
    rp = _fit(
        Classifier(plain=False),
        devices=2,
        strategy=RoundPipeStrategy(num_microbatch=num_microbatch),
    )
    assert rp.losses == pytest.approx(ref.losses, rel=TOL)
    assert max_rel_err(params_of(rp), params_of(ref)) <= TOL


def test_default_arguments_match_plain_lightning() -> None:
    """strategy="roundpipe" with nothing else: the default microbatch count (devices + 1)."""
    ref = _plain()
    rp = _fit(Classifier(plain=False), devices=3, strategy="roundpipe")
    assert rp.losses == pytest.approx(ref.losses, rel=TOL)
    assert max_rel_err(params_of(rp), params_of(ref)) <= TOL


def test_sum_is_one_argument_away() -> None:
    """loss_reduction="sum": the microbatch means (rows 3/3/2/2) are added up."""
    x, y = next(iter(_loader()))
    with torch.no_grad():
        net = Classifier(plain=True).net
        expect = sum(
            F.cross_entropy(net(a), b) for a, b in zip(x.split([3, 3, 2, 2]), y.split([3, 3, 2, 2]))
        )
    rp = _fit(
        Classifier(plain=False),
        devices=2,
        strategy=RoundPipeStrategy(num_microbatch=4, loss_reduction="sum"),
    )
    assert rp.losses[0] == pytest.approx(float(expect), rel=TOL)


@pytest.mark.parametrize("bad", ["avg", None, 2])
def test_bad_loss_reduction_is_refused(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="loss_reduction"):
        RoundPipeStrategy(loss_reduction=bad)
