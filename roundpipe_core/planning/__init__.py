"""Planning: pure functions over plans and timings -- no threads, no locks, no devices:
layouts and plans, the schedule (job list), profiles, the partition search, the event
simulator (with the planner's one iteration-time estimate) and the planner.

Imports point down to :mod:`roundpipe_core.kinds` only (``tests/core/test_layering.py``).
"""

from typing import cast

from .plan import AutoPlanner, ModelExecutePlan
from .planner import auto

# The planner sits above plan.py (it runs the simulator, which reads plans), so the
# wing, not plan.py, connects the published spelling ModelExecutePlan.auto to it:
# importing any planning module runs this first. (cast: the planner's overloads are
# one callable of the protocol's shape, which mypy does not infer from overloads)
ModelExecutePlan.install_planner(cast(AutoPlanner, auto))

__all__ = ["ModelExecutePlan", "auto"]
