"""``forward()`` with autograd: the pipelined forward inside an ``autograd.Function``
whose backward (:meth:`AutogradForward.backward_phase`) splits the output gradients per
microbatch like the outputs were merged, runs the backward plan on the pool (the
parameter gradients go to the masters) and merges the input gradients for the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import batch as batching
from .config import RoundPipeRunConfig
from .kinds import RunType
from .planning.plan import ModelExecutePlan
from .planning.schedule import Job, build_schedule
from .running.runtime import PipelineRun
from .stepping.pipelined import to_output_device

__all__ = ["AutogradForward"]


class AutogradForward:
    """One ``forward()`` call under grad mode (see the module docstring).

    Args:
        cfg / plan / split: the call's configuration, plan and split inputs.
        num_devices: devices of the pool.
        new_run: a ``TRAIN`` run's state, given which input leaves take a gradient and
            the backward's jobs.
        execute: run a job list of a run on the pool (blocking), serialized with the
            RoundPipe's other calls.
    """

    def __init__(
        self,
        cfg: RoundPipeRunConfig,
        plan: ModelExecutePlan,
        split: batching.SplitInputs,
        num_devices: int,
        new_run: Callable[[list[bool], list[Job]], PipelineRun],
        execute: Callable[[PipelineRun, list[Job]], None],
    ) -> None:
        self.cfg, self.plan, self.num_devices = cfg, plan, num_devices
        self.new_run, self.execute = new_run, execute
        self.split = split
        self.mbs = split.parts
        self.merged: batching.MergedOutputs | None = None
        self.run_state: PipelineRun | None = None
        self.out_leaves: list[Any] = []
        self.out_rebuild: Any = None
        self.in_leaves: list[Any] = []
        self.bwd_jobs: list[Job] = []

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The call's merged output, part of the caller's autograd graph."""
        self.in_leaves, _ = batching.flatten((args, kwargs))
        tensors = [x for x in self.in_leaves if isinstance(x, torch.Tensor)]
        # a leaf that requires grad: backward reaches the Function even when no input does
        dummy = torch.zeros((), requires_grad=True)
        outs = _PipelineFunction.apply(self, dummy, *tensors)
        it = iter(outs)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self.out_leaves]
        return to_output_device(self.out_rebuild(leaves), self.cfg.output_device)

    def forward_phase(self, needs_grad: list[bool]) -> tuple[torch.Tensor, ...]:
        # which leaves of the (args, kwargs) pytree take a gradient
        it = iter(needs_grad)
        needs = [next(it) if isinstance(x, torch.Tensor) else False for x in self.in_leaves]
        schedule = functools.partial(
            build_schedule, self.plan, RunType.TRAIN, self.num_devices, len(self.mbs)
        )
        jobs = schedule(phase="forward")
        # the backward's jobs are known now: the run is complete before it starts
        self.bwd_jobs = schedule(phase="backward", start_device=len(jobs) % self.num_devices)
        run = self.new_run(needs, self.bwd_jobs)  # (its inputs in place)
        self.execute(run, jobs)
        self.run_state = run
        outputs = [run.outputs[i] for i in range(len(self.mbs))]
        self.merged = batching.merge_outputs_with_grad(self.cfg.merge_output, outputs)
        self.out_leaves, self.out_rebuild = batching.flatten(self.merged.merged)
        return tuple(x for x in self.out_leaves if isinstance(x, torch.Tensor))

    def backward_phase(
        self, grad_outputs: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        run = self.run_state
        if run is None:
            raise RuntimeError("backward through a RoundPipe forward can only run once")
        n = len(self.mbs)
        assert self.merged is not None  # set by forward_phase
        it = iter(grad_outputs)
        leaf_grads = [next(it) if isinstance(x, torch.Tensor) else None for x in self.out_leaves]
        per_mb = self.merged.split_output_grads(leaf_grads)
        for m in range(n):
            run.put_grad(len(run.layers), m, per_mb[m])
        self.execute(run, self.bwd_jobs)
        run.drop_activations()
        self.run_state = None
        # the input tensors' gradients, joined over microbatches as the inputs were split
        if not any(run.input_needs_grad or []):
            return [None for x in self.in_leaves if isinstance(x, torch.Tensor)]
        joined = self.split.join_input_grads([run.take_grad(0, m) or [] for m in range(n)])
        return [g for g, x in zip(joined, self.in_leaves) if isinstance(x, torch.Tensor)]


class _PipelineFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, call: AutogradForward, dummy: torch.Tensor, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)
        outs = call.forward_phase(list(ctx.needs_input_grad[2:]))
        non_diff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        grads = ctx.call.backward_phase(grad_outputs)
        return (None, None, *grads)
