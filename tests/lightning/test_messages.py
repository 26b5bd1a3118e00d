"""RoundPipeStrategy says its setup facts -- the pool, plan and step, the host memory the run
needs, why a run that could overlap its iterations runs blocking -- the way Lightning says
its own ("GPU available: ..."): through Lightning's rank-zero logger, visible in a default
run, once, rank zero only, in a few lines; the whole host-memory table at DEBUG."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from rpl_helpers import SeqModule, loader, rp_trainer

from roundpipe_lightning import RoundPipeStrategy


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
    budget = lightning_log.saying("host memory: needs")
    blocking = lightning_log.saying("runs blocking")
    assert lightning_own and len(budget) == 1 and len(blocking) == 1
    assert "available" in budget[0].getMessage()
    assert "ReadsGrads.on_before_optimizer_step" in blocking[0].getMessage()
    for record in budget + blocking:
        # the same logger and level as Lightning's own line, so visible wherever it is
        assert record.name == lightning_own[0].name and record.levelno == logging.INFO
    assert logging.getLogger(budget[0].name).isEnabledFor(logging.INFO)


def test_a_synchronous_run_does_not_explain_that_it_blocks(lightning_log) -> None:
    rp_trainer(max_steps=1, async_step=False).fit(SeqModule(), loader())
    assert lightning_log.saying("host memory: needs")
    assert not lightning_log.saying("runs blocking")


def test_default_setup_says_a_few_lines_and_the_budget_table_at_debug(
    lightning_log, caplog: pytest.LogCaptureFixture
) -> None:
    """A default run adds two lines to Lightning's own: the pool, plan and step mode, and
    the host memory the run needs against what is available. The whole budget table
    (a dozen lines, most of them zeros on CPU workers) is a DEBUG record."""
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.DEBUG, logger="lightning.pytorch"):
        trainer.fit(SeqModule(), loader())
    shown = [r for r in lightning_log.records if r.levelno >= logging.INFO]
    ours = [r.getMessage() for r in shown if "RoundPipe" in r.getMessage()]
    assert sum(len(m.splitlines()) for m in ours) <= 3, ours
    said = "\n".join(ours)
    assert "2 CPU workers" in said and 'plan "' in said and "step synchronous" in said
    assert "host memory: needs" in said and "available" in said
    assert "host memory budget for" not in said  # the table is not shown by default
    tables = [r for r in lightning_log.records if "host memory budget for" in r.getMessage()]
    assert len(tables) == 1 and tables[0].levelno == logging.DEBUG
    table = tables[0].getMessage()
    assert "optimizer state" in table and "worker stage copies" in table


class _BecomeRankOne(L.Callback):
    """After the strategy set the ranks (setup_environment), before its setup()."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        rank_zero_only.rank = 1  # type: ignore[attr-defined]


def test_other_ranks_say_nothing(lightning_log, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # restored afterwards
    trainer = rp_trainer(max_steps=2, async_step=True, callbacks=[_BecomeRankOne()])
    trainer.fit(ReadsGrads(), loader())
    assert not lightning_log.saying("host memory")
    assert not lightning_log.saying("runs blocking")


def test_a_run_that_cannot_fit_is_refused_with_the_table(
    lightning_log, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary's "available" is the number the check compares with: too little, and
    the set-up refuses with the whole table (the one place it is shown unasked)."""
    import roundpipe_lightning.session as session_module
    from roundpipe_core.running.host_memory import HostMemoryError

    monkeypatch.delenv("ROUNDPIPE_SKIP_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(session_module, "available_host_memory", lambda: 1024)
    with pytest.raises(HostMemoryError, match=r"(?s)only 1 KiB is available.*host memory budget"):
        rp_trainer(max_steps=1).fit(SeqModule(), loader())
    assert lightning_log.saying("1 KiB available")
