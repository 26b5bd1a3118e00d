"""Planning: pure functions over plans and timings -- no threads, no locks, no devices:
layouts and plans, the schedule (job list), profiles, the partition search, the event
simulator (with the planner's one iteration-time estimate) and the planner.

Imports point down to :mod:`roundpipe_core.kinds` only (``tests/core/test_layering.py``).
"""

from .plan import ModelExecutePlan
from .planner import auto

# The planner sits above plan.py, so the wing connects ModelExecutePlan.auto to it
# (importing any planning module runs this first).
ModelExecutePlan.install_planner(auto)

__all__ = ["ModelExecutePlan", "auto"]
