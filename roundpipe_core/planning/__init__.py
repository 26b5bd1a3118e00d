"""Planning: pure functions over plans and timings — no threads, no locks, no devices.

* ``layout`` / ``plan``: layout strings and :class:`ModelExecutePlan` (stages, owners,
  validation, dict form);
* ``schedule``: the job list of one iteration (the data the runtime executes and the
  simulator times);
* ``profile``: per-layer costs and memory read from a timer;
* ``partition`` / ``search`` / ``baseline``: stage partitions and the search over them;
* ``simulate`` / ``simresult``: the event simulator of a job list;
* ``planner``: :meth:`ModelExecutePlan.auto`.

Imports point down to :mod:`roundpipe_core.kinds` only (``tests/core/test_layering.py``).
"""
