"""Public home of the simulator (``from roundpipe_core.simulate import simulate``).

The simulator is planning code and lives in :mod:`roundpipe_core.planning.simulate`;
this module re-exports its public names under the documented spelling."""

from .planning import simulate as _simulate
from .planning.simulate import *  # noqa: F403 - the same public names

__all__ = list(_simulate.__all__)
