"""Public home of the simulator (the published spelling): the public names of
:mod:`roundpipe_core.planning.simulate`."""

from .planning import simulate as _simulate
from .planning.simulate import *  # noqa: F403 - the same public names

__all__ = list(_simulate.__all__)
