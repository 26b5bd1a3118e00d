"""Public home of :class:`ModelTimer` (the published spelling); it lives in
:mod:`roundpipe_core.running.timer`, so ``ModelTimer.VERBOSE = True`` here is the engine's."""

from .running.timer import ModelTimer

__all__ = ["ModelTimer"]
