"""The RoundPipe the strategy builds: the engine's ``RoundPipe`` plus the few things
a Lightning run needs around each pipelined call.

* **Loss multiplier.** Lightning divides the loss by ``accumulate_grad_batches``
  before ``backward`` and ``16-mixed`` multiplies it by the loss scale. A
  ``forward_backward`` call backpropagates inside the engine, so the strategy
  applies both factors to every microbatch loss (``loss_fn(out, y) * factor``)
  and returns the unscaled loss to the user.
* **A plan per run type.** A plan made for ``forward_backward`` ("fused") is not
  valid for inference, so the strategy's plans (a layout string, ``"auto"``,
  :class:`~roundpipe_lightning.AutoReplan`) are kept per run type and used by the
  calls of that type unless the call passes its own ``execute_plan``.
* **Wall time** of the last pipelined call, for the bubble ratio of
  :class:`~roundpipe_lightning.StageTimeLogger`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


class LightningRoundPipe(RoundPipe):
    """``RoundPipe`` with per-run-type plans and a loss multiplier (see the module docstring).

    It is a ``RoundPipe`` in every other respect: ``LightningModule.roundpipe`` is an
    instance of this class.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Plain attributes (not registered as submodules / buffers).
        self.plans: dict[str, ModelExecutePlan] = {}
        self.loss_multiplier: Callable[[], float] | None = None
        self.last_call_ms: float = 0.0
        self.last_call_samples: int = 0
        self.last_call_tokens: int = 0

    # -- plans -------------------------------------------------------------------------
    def set_plan(self, run_type: str, plan: ModelExecutePlan | None) -> None:
        """Use ``plan`` for calls of ``run_type`` ("infer", "train", "fused"); ``None``
        returns that run type to the model's default plan."""
        if plan is None:
            self.plans.pop(run_type, None)
            return
        plan.check_valid(self.num_layers, run_type, self.num_devices)
        self.plans[run_type] = plan

    def plan_for(
        self, run_type: str, run_config: RoundPipeRunConfig | None = None
    ) -> ModelExecutePlan:
        """The plan a call of ``run_type`` with ``run_config`` runs."""
        if run_config is not None and run_config.execute_plan is not None:
            return run_config.execute_plan
        if run_type in self.plans:
            return self.plans[run_type]
        if self.model_run_config.execute_plan is not None:
            return self.model_run_config.execute_plan
        return self.default_plan(run_type)

    def _with_plan(
        self, run_config: RoundPipeRunConfig | None, run_type: str
    ) -> RoundPipeRunConfig | None:
        plan = self.plans.get(run_type)
        if plan is None or (run_config is not None and run_config.execute_plan is not None):
            return run_config
        return replace(run_config or RoundPipeRunConfig(), execute_plan=plan)

    # -- pipelined calls ---------------------------------------------------------------
    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        cfg = self._config(roundpipe_run_config)
        requires_grad = cfg.requires_grad
        if requires_grad is None:
            requires_grad = torch.is_grad_enabled() and bool(self._masters)
        run_config = self._with_plan(roundpipe_run_config, "train" if requires_grad else "infer")
        t0 = time.perf_counter()
        out = super().forward(*args, roundpipe_run_config=run_config, **kwargs)
        self.last_call_ms = (time.perf_counter() - t0) * 1000.0
        return out

    def forward_backward(
        self,
        input_args: tuple = (),
        input_kwargs: dict | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        factor = float(self.loss_multiplier()) if self.loss_multiplier is not None else 1.0
        if factor != 1.0 and callable(loss_fn):
            user_loss_fn = loss_fn

            def loss_fn(output: Any, target: Any) -> torch.Tensor:
                return user_loss_fn(output, target) * factor

        t0 = time.perf_counter()
        result = super().forward_backward(
            input_args=input_args,
            input_kwargs=input_kwargs,
            label=label,
            loss_fn=loss_fn,
            return_outputs=return_outputs,
            run_config=self._with_plan(run_config, "fused"),
        )
        self.last_call_ms = (time.perf_counter() - t0) * 1000.0
        self.last_call_samples, self.last_call_tokens = _batch_size(input_args, input_kwargs)
        if factor == 1.0:
            return result
        if return_outputs:
            loss, outputs = result
            return loss / factor, outputs
        return result / factor


def _batch_size(args: Any, kwargs: Any) -> tuple[int, int]:
    """(samples, tokens) of a call: the leading dimension of the first input tensor and,
    if that tensor holds integer token ids, its number of elements (else 0)."""
    stack = [args, kwargs]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            samples = int(x.shape[0]) if x.dim() > 0 else 1
            tokens = (
                x.numel() if not (x.is_floating_point() or x.is_complex()) and x.dim() >= 2 else 0
            )
            return samples, tokens
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return 0, 0
