"""Running: one pipelined call on the device pool.

``devices/`` (the pool, CPU and CUDA workers, pinned memory), ``runtime`` (a worker's
queue of jobs), ``transfer`` / ``activations`` / ``streams`` (uploads, downloads, random
streams), ``timer`` / ``trace`` (what a call measured), ``host_memory`` (a run's budget;
``meta_quant`` budgets 4-bit models too large to build). Reads plans from
:mod:`roundpipe_core.planning`; knows nothing of the optimizer (``stepping`` is above).
"""
