"""Running: one pipelined call on the device pool (its modules: docs/architecture.md,
"Code layout"). Reads plans from :mod:`roundpipe_core.planning`; knows nothing of
the optimizer (``stepping`` is above).
"""
