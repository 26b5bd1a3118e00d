"""The strategy's run state: named phases and the ledger of steps in flight and lost."""

from __future__ import annotations

import threading

import pytest

from roundpipe_lightning.session import StepLedger
from roundpipe_lightning.strategy import Phase, RunState

pytestmark = pytest.mark.host_only


def test_a_run_goes_through_its_phases() -> None:
    run = RunState()
    assert run.phase is Phase.NO_RUN and not run.is_open
    run.open()
    assert run.phase is Phase.OPEN and run.is_open and not run.in_training_step
    with run.training_step():
        assert run.in_training_step and run.is_open
    assert run.phase is Phase.OPEN
    run.fail()
    assert run.phase is Phase.FAILED and run.is_open  # still to be closed
    assert run.close() is True  # closing knows the run had failed
    assert run.phase is Phase.CLOSED and not run.is_open
    run.end()
    assert run.phase is Phase.NO_RUN


def test_training_step_phase_ends_when_the_step_raises() -> None:
    run = RunState()
    run.open()
    with pytest.raises(RuntimeError), run.training_step():
        raise RuntimeError("boom")
    assert run.phase is Phase.OPEN


def test_failure_after_close_changes_nothing() -> None:
    run = RunState()
    run.open()
    assert run.close() is False
    run.fail()
    assert run.phase is Phase.CLOSED


def test_ledger_counts_lost_steps_across_threads() -> None:
    ledger = StepLedger()
    for _ in range(3):
        ledger.queued()
    done = threading.Thread(target=ledger.applied)  # the optimizer thread applies one
    done.start()
    done.join(timeout=10)
    ledger.mark_failed()
    assert ledger.step_failed
    assert ledger.take_back() == 2
    assert ledger.lost == 2 and not ledger.step_failed
    ledger.queued()
    ledger.mark_failed()
    assert ledger.take_back() == 1 and ledger.lost == 3  # lost steps add up
    ledger.reset()
    assert ledger.lost == 0
