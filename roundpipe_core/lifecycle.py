"""The end of a RoundPipe's life: its threads and memory freed, in an order that is safe
while devices may still copy (``close()``, garbage collection or interpreter exit)."""

from __future__ import annotations

import warnings
from typing import Any

from .running.devices.pool import DevicePool
from .stepping.owner import StepOwner

__all__ = ["release_roundpipe"]


def release_roundpipe(
    name: str, pool: DevicePool, owns_pool: bool, steps: StepOwner, pin_handle: Any = None
) -> None:
    """Free a RoundPipe's threads and memory (``close()``, garbage collection or exit).

    It never waits for a step still running -- a stuck ``step_fn`` must not hang
    interpreter exit -- and warns about a step error nobody has seen.

    Order: the pool drains its queues and its devices finish every copy
    (``DevicePool.close``; ``synchronize`` for a pool passed in, which stays open)
    before registered host memory is unregistered: unregistering under a DMA that
    still reads it is undefined. A pool that did not drain leaves it registered.
    """
    unseen = steps.unobserved_error()
    steps.shutdown()
    drained = pool.close() if owns_pool else pool.synchronize()
    if pin_handle is not None:
        if drained:
            pin_handle.release()
        elif pin_handle.registered:
            warnings.warn(
                f"RoundPipe {name!r}: a device did not finish its work within the close "
                "timeout; its registered host memory stays page-locked until the process "
                "exits rather than being unregistered under copies still reading it",
                RuntimeWarning,
                stacklevel=1,
            )
    if unseen is not None:
        warnings.warn(
            f"RoundPipe {name!r}: an optimizer step raised {unseen!r} and the error was never "
            "raised to the caller; call synchronize() (or close()) to see step errors",
            RuntimeWarning,
            stacklevel=1,
        )
