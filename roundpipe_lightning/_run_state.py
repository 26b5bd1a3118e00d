"""The run state of a :class:`~roundpipe_lightning.RoundPipeStrategy`: one object with
named phases instead of flags spread over the strategy.

Phases (``Phase``), in the order a run goes through them::

    NO_RUN --setup--> OPEN <--training_step--> IN_TRAINING_STEP
                        |  \\--on_exception--> FAILED
                        v                        |
                      CLOSED <-----close---------/
    (teardown: back to NO_RUN)

``overlap`` (whether this fit overlaps its iterations) is decided once at train
start. The :class:`StepLedger` counts the optimizer steps Lightning counted when they
were queued against those that reached the weights, from both the training thread
and the optimizer thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

__all__ = ["Phase", "RunState", "StepLedger"]


class Phase(str, Enum):
    """Where a run stands."""

    NO_RUN = "no_run"  # no RoundPipe: before setup, after teardown
    OPEN = "open"  # the RoundPipe runs calls, outside training_step
    IN_TRAINING_STEP = "in_training_step"  # inside the LightningModule's training_step
    FAILED = "failed"  # Lightning reported an exception: closing tolerates errors
    CLOSED = "closed"  # the RoundPipe was closed (its worker threads stopped)


class StepLedger:
    """Optimizer steps in flight and lost, shared by the training and optimizer threads.

    Lightning counts a step when ``optimizer_step`` returns; an asynchronous step reaches
    the weights later, on the optimizer thread, or fails there. ``lost`` is what a
    checkpoint written now must take back from Lightning's count.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unapplied = 0
        self._lost = 0
        self._failed = False

    def queued(self) -> None:
        """A step was handed to the optimizer thread (training thread)."""
        with self._lock:
            self._unapplied += 1

    def applied(self) -> None:
        """A queued step reached the weights (optimizer thread)."""
        with self._lock:
            self._unapplied -= 1

    def mark_failed(self) -> None:
        """A queued step raised on the optimizer thread."""
        with self._lock:
            self._failed = True

    @property
    def step_failed(self) -> bool:
        """Whether a queued step failed and was not yet taken back."""
        with self._lock:
            return self._failed

    def take_back(self) -> int:
        """After a failure, with nothing in flight: the steps still unapplied are lost.
        Returns how many were lost now."""
        with self._lock:
            lost, self._unapplied, self._failed = self._unapplied, 0, False
            self._lost += lost
            return lost

    @property
    def lost(self) -> int:
        """Steps Lightning counted that never reached the weights."""
        with self._lock:
            return self._lost

    def reset(self) -> None:
        with self._lock:
            self._unapplied = self._lost = 0
            self._failed = False


class RunState:
    """The strategy's run state (see the module docstring)."""

    def __init__(self) -> None:
        self.phase = Phase.NO_RUN
        self.overlap = False
        self.steps = StepLedger()

    @property
    def is_open(self) -> bool:
        """Whether the RoundPipe exists and was not closed."""
        return self.phase in (Phase.OPEN, Phase.IN_TRAINING_STEP, Phase.FAILED)

    @property
    def in_training_step(self) -> bool:
        return self.phase is Phase.IN_TRAINING_STEP

    @property
    def failed(self) -> bool:
        return self.phase is Phase.FAILED

    def open(self) -> None:
        """A RoundPipe was built (setup)."""
        self.phase = Phase.OPEN

    @contextmanager
    def training_step(self) -> Iterator[None]:
        """Inside the LightningModule's ``training_step``."""
        before = self.phase
        if before is Phase.OPEN:
            self.phase = Phase.IN_TRAINING_STEP
        try:
            yield
        finally:
            if self.phase is Phase.IN_TRAINING_STEP:
                self.phase = before

    def fail(self) -> None:
        """Lightning reported an exception (``on_exception``)."""
        if self.is_open:
            self.phase = Phase.FAILED

    def close(self) -> bool:
        """The RoundPipe is being closed. Returns whether the run had failed."""
        failed = self.phase is Phase.FAILED
        self.phase = Phase.CLOSED
        self.overlap = False
        return failed

    def end(self) -> None:
        """Teardown: nothing of this run remains."""
        self.phase = Phase.NO_RUN
        self.overlap = False
        self.steps.reset()
