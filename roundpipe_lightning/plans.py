"""Turn the strategy's ``execute_plan`` argument into a ``ModelExecutePlan``.

Accepted forms (all checked against the model's layers and the device pool):

* ``None`` -- the engine's default plan;
* ``"auto"`` -- ``ModelExecutePlan.auto(run_type, roundpipe)`` (before any
  measurement the layer timer's estimates are proportional to layer size;
  :class:`~roundpipe_lightning.AutoReplan` re-plans from measured times);
* a layout string, e.g. ``"fwd=3,2 bwd=1,2,2,1"`` or with owner devices
  ``"fwd=0:3,1:2 bwd=0:1,1:2,0:2,1:1"`` (``;`` also separates) -- see
  ``ModelExecutePlan.from_layout``;
* a dict of ``ModelExecutePlan.from_layout`` arguments (``{"fwd": "3,2", "bwd": "1,2,2,1"}``);
* a ``ModelExecutePlan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from roundpipe_core import ModelExecutePlan

__all__ = ["describe_plan", "resolve_execute_plan"]


def _one_plan(plan: ModelExecutePlan | list[ModelExecutePlan]) -> ModelExecutePlan:
    """``ModelExecutePlan.auto`` of one model returns one plan (a list for several)."""
    assert isinstance(plan, ModelExecutePlan)
    return plan


def describe_plan(plan: ModelExecutePlan) -> str:
    """One line for logs: the layout string (``fwd=3,2 bwd=1,2,2,1``)."""
    try:
        return plan.to_layout_string()
    except Exception:  # noqa: BLE001 - any plan still has a repr
        return repr(plan)


def resolve_execute_plan(
    spec: Any, roundpipe: Any, run_type: str = "fused"
) -> ModelExecutePlan | None:
    """The plan ``spec`` describes for ``roundpipe`` and ``run_type``.

    Raises:
        ValueError: the spec is malformed or does not fit the model / pool; the
            message names the offending item and repeats the spec.
        TypeError: the spec has an unsupported type.
    """
    if spec is None:
        return None
    num_layers, num_devices = roundpipe.num_layers, roundpipe.num_devices
    try:
        if isinstance(spec, ModelExecutePlan):
            plan = spec
        elif isinstance(spec, str) and spec.strip().lower() == "auto":
            plan = _one_plan(ModelExecutePlan.auto(run_type, roundpipe))
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
