"""The strategies' ``execute_plan`` argument as a ``ModelExecutePlan``, checked against
the layers and the pool."""

from __future__ import annotations

from typing import Any

from roundpipe_core import ModelExecutePlan

__all__ = ["resolve_execute_plan"]


def resolve_execute_plan(
    spec: Any, roundpipe: Any, run_type: str = "fused", owner: str = "RoundPipeStrategy"
) -> ModelExecutePlan | None:
    """The plan ``spec`` describes; a ValueError (naming the item and repeating the spec)
    where it is malformed or does not fit."""
    if spec is None:
        return None
    num_layers, num_devices = roundpipe.num_layers, roundpipe.num_devices
    try:
        if isinstance(spec, ModelExecutePlan):
            plan = spec
        elif isinstance(spec, str) and spec.strip().lower() == "auto":
            plan = ModelExecutePlan.auto(run_type, roundpipe)
            assert isinstance(plan, ModelExecutePlan)  # (a list for several models)
        elif isinstance(spec, str):
            plan = ModelExecutePlan.from_layout_string(
                spec, num_layers=num_layers, num_devices=num_devices, run_type=run_type
            )
        else:  # a Mapping (SessionSettings.of checked the type)
            unknown = set(spec) - {"fwd", "bwd", "fwd_owners", "bwd_owners"}
            if unknown:
                raise ValueError(
                    f"unknown layout key(s) {sorted(unknown)}; use fwd, bwd, fwd_owners, bwd_owners"
                )
            plan = ModelExecutePlan.from_layout(
                **dict(spec), num_layers=num_layers, num_devices=num_devices, run_type=run_type
            )
        plan.check_valid(num_layers, run_type, num_devices)
    except ValueError as exc:
        raise ValueError(
            f"{owner}(execute_plan={spec!r}) does not fit the model ({num_layers} layers, "
            f"{num_devices} device(s)): {exc}"
        ) from exc
    return plan
