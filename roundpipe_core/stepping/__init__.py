"""Stepping: the optimizer side of a RoundPipe.

* ``masters``: fp32 master copies of the trainable parameters and their gradients;
* ``stepper``: the optimizer thread (queued steps, their order, their failures);
* ``versions``: which step's weights the host copy holds, and their publication;
* ``layerwise``: stepping layer by layer as gradients complete;
* ``pipelined``: overlapped iterations (per-run gradient buffers, pending results).

Drives calls through :mod:`roundpipe_core.running`; the model
(:mod:`roundpipe_core.model`) sits above it.
"""
