"""The strategies' ``execute_plan`` argument as a ``ModelExecutePlan``, checked against
the layers and the pool."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from roundpipe_core import ModelExecutePlan

__all__ = ["describe_plan", "resolve_execute_plan"]


def describe_plan(plan: ModelExecutePlan) -> str:
    """One line for logs: the layout string (``fwd=3,2 bwd=1,2,2,1``)."""
    try:
        return plan.to_layout_string()
    except Exception:  # noqa: BLE001 - any plan still has a repr
        return repr(plan)


def resolve_execute_plan(
    spec: Any, roundpipe: Any, run_type: str = "fused"
) -> ModelExecutePlan | None:
    """The plan ``spec`` describes; a ValueError (naming the item and repeating the spec)
    where it is malformed or does not fit, a TypeError for another type."""
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
        elif isinstance(spec, Mapping):
            unknown = set(spec) - {"fwd", "bwd", "fwd_owners", "bwd_owners"}
            if unknown:
                raise ValueError(
                    f"unknown layout key(s) {sorted(unknown)}; use fwd, bwd, fwd_owners, bwd_owners"
                )
            plan = ModelExecutePlan.from_layout(
                **dict(spec), num_layers=num_layers, num_devices=num_devices, run_type=run_type
            )
        else:
            raise TypeError(
                "execute_plan must be None, 'auto', a layout string, a dict of layout arguments or a "
                f"ModelExecutePlan, got {type(spec).__name__}"
            )
        plan.check_valid(num_layers, run_type, num_devices)
    except ValueError as exc:
        raise ValueError(
            f"RoundPipeStrategy(execute_plan={spec!r}) does not fit the model ({num_layers} layers from "
            f"configure_sequential(), {num_devices} device(s)): {exc}"
        ) from exc
    return plan
