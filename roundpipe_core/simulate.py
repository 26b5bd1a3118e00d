"""Public home of the simulator (``from roundpipe_core.simulate import simulate``).

The simulator is planning code and lives in :mod:`roundpipe_core.planning.simulate`;
this module re-exports its public names under the documented spelling."""

from .planning.simulate import (
    BOUND_SCHEDULES,
    POLICIES,
    SimEvent,
    SimResult,
    balanced_stages,
    device_peak_bytes,
    makespan_ms,
    simulate,
    simulate_bound_stages,
)

__all__ = [
    "BOUND_SCHEDULES",
    "POLICIES",
    "SimEvent",
    "SimResult",
    "balanced_stages",
    "device_peak_bytes",
    "makespan_ms",
    "simulate",
    "simulate_bound_stages",
]
