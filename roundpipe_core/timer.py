"""Public home of :class:`ModelTimer` (``from roundpipe_core.timer import ModelTimer``),
the published package's spelling. The timer lives with the code that feeds it, in
:mod:`roundpipe_core.running.timer`; this module re-exports the same objects, so
``ModelTimer.VERBOSE = True`` here is the engine's switch."""

from .running.timer import ModelTimer

__all__ = ["ModelTimer"]
