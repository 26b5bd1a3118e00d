"""RoundPipeStrategy says its setup facts -- the host-memory budget, why a run that could
overlap its iterations runs blocking -- the way Lightning says its own ("GPU available:
..."): through Lightning's rank-zero logger, visible in a default run, once, rank zero only."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from rpl_helpers import SeqModule, loader, rp_trainer


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def saying(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if text in r.getMessage()]


@pytest.fixture
def lightning_log():
    """What reaches the "lightning.pytorch" logger -- the one Lightning configures at import
    (INFO, a stream handler unless the root logger has one) for its own setup messages."""
    handler = _Records()
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


class ReadsGrads(SeqModule):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norm = sum(float(p.grad.norm()) for g in optimizer.param_groups for p in g["params"])


def test_budget_and_blocking_reason_are_said_like_lightnings_setup_facts(lightning_log) -> None:
    rp_trainer(max_steps=2, async_step=True).fit(ReadsGrads(), loader())
    lightning_own = lightning_log.saying("GPU available")
    budget = lightning_log.saying("RoundPipe host memory")
    blocking = lightning_log.saying("runs blocking")
    assert lightning_own and len(budget) == 1 and len(blocking) == 1
    assert "host memory budget for" in budget[0].getMessage()
    assert "ReadsGrads.on_before_optimizer_step" in blocking[0].getMessage()
    for record in budget + blocking:
        # the same logger and level as Lightning's own line, so visible wherever it is
        assert record.name == lightning_own[0].name and record.levelno == logging.INFO
    assert logging.getLogger(budget[0].name).isEnabledFor(logging.INFO)


def test_a_synchronous_run_does_not_explain_that_it_blocks(lightning_log) -> None:
    rp_trainer(max_steps=1, async_step=False).fit(SeqModule(), loader())
    assert lightning_log.saying("RoundPipe host memory")
    assert not lightning_log.saying("runs blocking")


class _BecomeRankOne(L.Callback):
    """After the strategy set the ranks (setup_environment), before its setup()."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        rank_zero_only.rank = 1  # type: ignore[attr-defined]


def test_other_ranks_say_nothing(lightning_log, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # restored afterwards
    trainer = rp_trainer(max_steps=2, async_step=True, callbacks=[_BecomeRankOne()])
    trainer.fit(ReadsGrads(), loader())
    assert not lightning_log.saying("RoundPipe host memory")
    assert not lightning_log.saying("runs blocking")
