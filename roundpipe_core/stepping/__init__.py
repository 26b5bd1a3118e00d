"""Stepping: the optimizer side of a RoundPipe.

* ``owner``: :class:`~roundpipe_core.stepping.owner.StepOwner`, the one object the
  model talks to (steps, waiting, gradient folding, the weight versions a call reads);
* ``masters``: fp32 master copies of the trainable parameters and their gradients;
* ``stepper``: the optimizer thread (queued steps, their order, their failures);
* ``versions``: which step's weights the host copy holds, and their publication;
* ``layerwise``: stepping layer by layer as gradients complete;
* ``pipelined``: overlapped iterations (per-run gradient buffers, pending results).

Outside this package only the owner, the masters, a call's buffers and handles, and
the layer-wise helpers are used (``tests/core/test_layering.py`` checks it). Drives
calls through :mod:`roundpipe_core.running`; the model (:mod:`roundpipe_core.model`)
sits above it.
"""
