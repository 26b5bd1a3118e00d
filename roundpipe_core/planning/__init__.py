"""Planning: pure functions over plans and timings — no threads, no locks, no devices.

* ``layout`` / ``plan``: layout strings and :class:`ModelExecutePlan` (stages, owners,
  validation, dict form);
* ``schedule``: the job list of one iteration (the data the runtime executes and the
  simulator times);
* ``profile``: per-layer costs and memory read from a timer;
* ``partition`` / ``search``: stage partitions and the search over them;
* ``simulate``: the event simulator of a job list, and the planner's one iteration-time
  estimate (``simulated_iteration_ms``);
* ``planner``: :meth:`ModelExecutePlan.auto` and the re-plan policy.

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
