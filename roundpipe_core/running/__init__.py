"""Running: one pipelined call on the device pool.

* ``devices/``: the pool and its workers (CPU threads that play devices, CUDA GPUs),
  device memory ledgers, pinned host memory;
* ``runtime``: a worker's queue of jobs, the call that drives them;
* ``transfer`` / ``streams``: stage uploads, gradient downloads, activation copies;
* ``timer`` / ``trace``: what a call measured, per layer and as a timeline;
* ``host_memory``: the host-memory budget of a run (``meta_quant``: a meta model laid
  out as bitsandbytes' 4-bit, to budget models too large to build).

Reads plans and schedules from :mod:`roundpipe_core.planning`; knows nothing of the
optimizer (:mod:`roundpipe_core.stepping` sits above it).
"""
