"""``RoundPipeFabricStrategy``: ``Fabric(strategy="roundpipe")``.

A Lightning Fabric strategy over the same engine as :class:`RoundPipeStrategy`, with
the same argument names and defaults::

    fabric = Fabric(strategy="roundpipe", accelerator="cpu", devices=2)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    opt.step()
    opt.zero_grad()

* ``fabric.setup(net, opt)`` wraps ``net`` (an ``nn.Sequential``, or a Hugging Face
  model a preset converts) in a ``RoundPipe`` whose pool is Fabric's ``devices``, in
  this one process, and points ``opt`` at the fp32 master copies. The returned
  module pipelines ``model(x)`` and has ``forward_backward``, ``synchronize`` and
  ``roundpipe`` (see :mod:`roundpipe_lightning._fabric_run`).
* ``opt.step()`` is ``roundpipe.step(...)``: the update runs on the masters
  (asynchronously with ``async_step=True``, one step stale) and clears their
  gradients; ``opt.zero_grad()`` after it costs nothing.
* ``fabric.backward(loss)`` backpropagates a loss computed from ``model(x)`` through
  the pipeline; for a loss ``forward_backward`` returned it does nothing (the call
  already backpropagated it).
* ``fabric.save`` / ``fabric.load`` hold the module's weights, its fp32 masters where
  their dtype differs from the weights' (``checkpoint["roundpipe"][key]``), the
  optimizer state and the layer timings; everything in flight is finished first.

Model state stays in host memory: ``fabric.device`` is the CPU, batches stay there,
and the pool's devices are RoundPipe's business.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core import distributed as D
from roundpipe_core.loss import LOSS_REDUCTIONS

from ._fabric_processes import FabricProcesses
from ._fabric_run import FabricRun
from ._setup import (
    build_roundpipe,
    check_bool,
    check_choice,
    check_loss_went_through,
    check_num_microbatch,
    check_pool_devices,
    check_step_request,
    check_type,
    fuse_optimizer,
    network_of,
    parse_dtype,
    point_at_masters,
)
from ._step import QueuedStep
from .checkpoint_io import CHECKPOINT_KEY, StreamingCheckpointIO
from .sharded_checkpoint import fabric_shards_dir, marker

__all__ = ["RoundPipeFabricStrategy"]

log = logging.getLogger(__name__)

_OWNER = "RoundPipeFabricStrategy"


def _check_precision(plugin: Precision) -> None:
    """Refuse a Fabric precision plugin the strategy does not run."""
    mixed_bf16 = isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed"
    if type(plugin) is not Precision and not mixed_bf16:
        name = getattr(plugin, "precision", type(plugin).__name__)
        raise ValueError(
            f"{_OWNER} runs Fabric(precision='32-true') or 'bf16-mixed', got {name!r}. For "
            "half-precision weights, cast the module yourself (net.to(torch.bfloat16)) and keep "
            "'32-true': the optimizer then updates fp32 master copies (optim_dtype)."
        )


class RoundPipeFabricStrategy(FabricProcesses):
    """Run the modules given to ``fabric.setup()`` with RoundPipe (see the module docstring).

    One process drives the whole pool (Fabric's ``devices``: N CPU workers or N GPUs), so
    it is a single-device strategy to Fabric: ``fabric.launch()`` is optional. Several
    nodes (``Fabric(num_nodes=N)``, one process per node started by torchrun, SLURM or
    the environment) are data parallel as under ``RoundPipeStrategy``: rank 0's weights
    are broadcast at ``fabric.setup()``, the master gradients are reduced over the nodes
    when ``opt.step()`` (or ``fabric.clip_gradients``) is called, and
    ``fabric.setup_dataloaders`` gives each node its ``DistributedSampler`` shard.

    The RoundPipe arguments are :class:`~roundpipe_lightning.RoundPipeStrategy`'s, with
    the same meanings and defaults.

    Args:
        loss_reduction: ``"mean"`` (default): a ``loss_fn`` returning a batch mean gives
            plain Fabric's loss and gradients for any microbatch count; ``"sum"``: the
            published sum of the microbatch losses.
        num_microbatch: microbatches per pipelined call (default: the engine's,
            :func:`~roundpipe_core.planning.plan.default_num_microbatch`: devices + 1 on
            GPUs; on CPU workers 1, or one per worker where the one-stage plan runs on
            every worker at once -- the default for a model without buffers).
        execute_plan: the plan of ``forward_backward`` (``None``, ``"auto"``, a layout
            string, a dict of ``from_layout`` arguments or a ``ModelExecutePlan``).
        optim_dtype: dtype of the master weights (default fp32; a name works too).
        pin_model: host memory of the parameters on CUDA ("alloc", "register", "off").
        async_step: overlap the step with the next iteration (one step stale); ``None``
            (default): ``True`` on GPUs, ``False`` on CPU workers.
        fuse_optimizer: switch Adam, AdamW, SGD, Adagrad to torch's fused CPU kernel.
        recompute_grain: "stage" or "layer" (None: the engine's default).
        preserve_rng_state: replay the forward's RNG in recompute (dropout masks).
        model_run_config: further ``RoundPipeRunConfig`` defaults.
        grad_reduce_op: with several nodes, "mean" (as DDP) or "sum" of the master
            gradients over the nodes.
        process_group_timeout: seconds (or a ``timedelta``) after which a collective whose
            peer died fails (default ``$ROUNDPIPE_DIST_TIMEOUT`` or 30 minutes).
        shard_host_state: with several nodes, each keeps master gradients, optimizer state
            and masters for its 1/N of the parameters only (``docs/multi-node.md``);
            ``fabric.save`` writes a shard per node.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: as for
            any Fabric strategy (normally left to ``Fabric(...)``). Precision: ``"32-true"``
            or ``"bf16-mixed"``.

    ``overlap_iterations`` has no Fabric counterpart: the loop is the user's, so pass
    ``blocking=False`` to ``forward_backward`` to overlap iterations. Several processes on
    one node (``torchrun --nproc-per-node 2``) are refused. The gradient reduction runs
    after the backward, not overlapped with it (the loop is the user's: which backward is
    the last of an accumulation window is not known).

    Raises:
        TypeError / ValueError: an argument of the wrong type or value (the message
            names the argument and what it accepts).
    """

    strategy_name = "roundpipe"

    def __init__(
        self,
        loss_reduction: str = "mean",
        num_microbatch: int | None = None,
        execute_plan: ModelExecutePlan | str | dict | None = None,
        optim_dtype: torch.dtype | str | None = torch.float32,
        pin_model: str = "alloc",
        async_step: bool | None = None,
        fuse_optimizer: bool = True,
        recompute_grain: str | None = None,
        preserve_rng_state: bool = True,
        model_run_config: RoundPipeRunConfig | None = None,
        grad_reduce_op: str = "mean",
        process_group_timeout: float | timedelta | None = None,
        shard_host_state: bool = False,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision
        )
        self.loss_reduction = check_choice(
            "loss_reduction", loss_reduction, LOSS_REDUCTIONS, _OWNER
        )
        check_choice("pin_model", pin_model, ("alloc", "register", "off"), _OWNER)
        check_choice("recompute_grain", recompute_grain, ("stage", "layer", None), _OWNER)
        check_type(
            "model_run_config",
            model_run_config,
            (RoundPipeRunConfig,),
            "a RoundPipeRunConfig",
            _OWNER,
        )
        check_type(
            "execute_plan",
            execute_plan,
            (ModelExecutePlan, str, Mapping),
            "'auto', a ModelExecutePlan, a layout string or a dict of from_layout arguments",
            _OWNER,
        )
        self.num_microbatch = check_num_microbatch(num_microbatch, _OWNER)
        self.execute_plan = execute_plan
        try:
            self.optim_dtype = parse_dtype(optim_dtype)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{_OWNER}: {exc}") from None
        self.pin_model = pin_model
        self._async_request = check_step_request(async_step, _OWNER)
        self.fuse_optimizer = check_bool("fuse_optimizer", fuse_optimizer, _OWNER)
        self.recompute_grain = recompute_grain
        self.preserve_rng_state = check_bool("preserve_rng_state", preserve_rng_state, _OWNER)
        self.model_run_config = model_run_config
        self.grad_reduce_op = check_choice(
            "grad_reduce_op", grad_reduce_op, ("mean", "sum"), _OWNER
        )
        self.shard_host_state = check_bool("shard_host_state", shard_host_state, _OWNER)
        try:
            self._process_group_timeout = D.resolve_timeout(process_group_timeout)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{_OWNER}: {exc}") from None
        # Fabric's connector fills these in (it looks for the attributes)
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        self._num_nodes = 1
        self._checked = False
        self._runs: list[FabricRun] = []

    # -- where it runs -----------------------------------------------------------------------
    @property
    def compute_devices(self) -> list[torch.device]:
        """The devices of the RoundPipe pool (Fabric's ``devices``)."""
        return list(self.parallel_devices or [torch.device("cpu")])

    @property
    def async_step(self) -> bool:
        """Whether the optimizer step overlaps the next iteration: as given, or, for
        ``async_step=None``, whether the pool's devices are GPUs (CPU workers: no)."""
        if self._async_request is not None:
            return self._async_request
        return self.compute_devices[0].type != "cpu"

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Streaming, atomic saves and memory-mapped loads (``StreamingCheckpointIO``)
        unless Fabric was given a ``CheckpointIO`` plugin."""
        if self._checkpoint_io is None:
            self._checkpoint_io = StreamingCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        # checked when Fabric(...) hands it over, before anything (the module) is converted
        if plugin is not None:
            _check_precision(plugin)
        self._precision = plugin

    def _check_run(self) -> None:
        """Refuse what this strategy cannot run, once, before the first module is built."""
        if self._checked:
            return
        self._check_processes()
        check_pool_devices(self.compute_devices, _OWNER, "Fabric")
        self._connect()  # here: Fabric calls setup_environment only from fabric.launch()
        self._checked = True
        if self._async_request is None:
            pool = "GPU" if self.compute_devices[0].type != "cpu" else "CPU-worker"
            rank_zero_info(
                f"{_OWNER}: async_step={self.async_step} on this {pool} pool "
                "(async_step=None follows the hardware; pass True or False to choose)"
            )

    @override
    def setup_environment(self) -> None:
        self._check_run()
        assert self.accelerator is not None
        self.accelerator.setup_device(self.compute_devices[0])

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Parameters stay in host memory; RoundPipe uploads stages to its devices.
        return None

    # -- set-up ------------------------------------------------------------------------------
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Wrap ``module`` in a RoundPipe (what ``model(x)`` runs) and give ``module`` the
        RoundPipe calls."""
        self._check_run()
        if not isinstance(module, nn.Module):
            raise TypeError(f"fabric.setup() takes an nn.Module, got {type(module).__name__}")
        if isinstance(module, RoundPipe):
            raise TypeError(
                "fabric.setup() got a RoundPipe; give it the plain nn.Sequential (or Hugging "
                f"Face model) instead -- {_OWNER} wraps it and returns the pipelined module"
            )
        FabricRun.check_free(module)  # before a RoundPipe claims its parameters
        net, original = network_of(module, "fabric.setup() got")
        rp = build_roundpipe(
            net,
            original,
            name=type(module).__name__,
            devices=self.compute_devices,
            model_run_config=self.model_run_config,
            num_microbatch=self.num_microbatch,
            recompute_grain=self.recompute_grain,
            preserve_rng_state=self.preserve_rng_state,
            optim_dtype=self.optim_dtype,
            pin_model=self.pin_model,
            async_step=self.async_step,
            execute_plan=self.execute_plan,
            loss_reduction=self.loss_reduction,
            source="fabric.setup() got",
            owner=_OWNER,
            loss_hint="compute the loss from out = model(x) and call fabric.backward(loss)",
        )
        dp = D.DataParallel(
            op=self.grad_reduce_op,
            overlap=False,  # the user's loop: the window's last backward is not known
            timeout=self._process_group_timeout,
            shard_host_state=self.shard_host_state,
        )
        try:
            run = FabricRun(rp, module, lambda: self.precision, dp)
        except BaseException:
            rp.close()
            raise
        try:
            dp.attach(rp)  # several nodes: every node starts from rank 0's weights
        except BaseException:
            run.close()
            raise
        self._runs.append(run)
        return rp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Point ``optimizer`` at the masters of the module whose parameters it holds."""
        runs = [run for run in self._runs if run.holds(optimizer)]
        if len(runs) != 1:
            where = "none of the parameters" if not runs else "parameters of several modules"
            raise ValueError(
                f"{type(optimizer).__name__} holds {where} of the modules set up with {_OWNER}; "
                "build each optimizer from one module's parameters and set it up with that "
                "module: model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=...))"
            )
        run = runs[0]
        point_at_masters(optimizer, run.rp, "the module's parameters()")  # (refuses LBFGS)
        if self.fuse_optimizer:
            fuse_optimizer(optimizer)  # on the masters (host, fp32)
        view = run.adopt(optimizer)
        # several nodes: one gradient reducer per optimizer (and, sharded, its ownership)
        run.dp.attach(run.rp, run.optimizers, async_step=self.async_step)
        return view

    def _run_of(self, obj: Any) -> FabricRun | None:
        """The run of a set-up module (its RoundPipe or the module itself) or optimizer."""
        for run in self._runs:
            if obj is run.rp or obj is run.module or run.owns(obj) is not None:
                return run
        return None

    # -- training ----------------------------------------------------------------------------
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backpropagate a loss computed from ``model(x)`` through the pipeline; nothing
        for a loss ``forward_backward`` returned (already backpropagated)."""
        if any(run.returned(tensor) for run in self._runs):
            return
        if not isinstance(tensor, Tensor) or not tensor.requires_grad:
            raise RuntimeError(
                "fabric.backward() got a tensor without an autograd graph. Under "
                f"{_OWNER} a loss is backpropagated by computing it with "
                "loss = model.forward_backward(input_args=(x,), label=y, loss_fn=...) (nothing "
                "else to call), or from out = model(x) and then fabric.backward(loss)."
            )
        for run in self._runs:
            check_loss_went_through(
                tensor,
                run.rp,
                f"the loss was computed by calling {type(run.module).__name__} directly (the "
                "module given to fabric.setup(), or model.module): its gradients would not "
                "reach the master weights the optimizer steps. Call the module fabric.setup() "
                "returned instead: out = model(x), or loss = model.forward_backward(...)",
            )
        for run in self._runs:
            run.check_not_reduced()
        super().backward(tensor, module, *args, **kwargs)
        for run in self._runs:
            run.grads_fresh = True

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Queue ``optimizer.step()`` on RoundPipe's optimizer thread (its own step clears
        the gradients); with ``async_step=False`` it has run when this returns."""
        run = self._run_of(optimizer)
        raw = run.owns(optimizer) if run is not None else None
        if run is None or raw is None:
            raise ValueError(
                f"{type(optimizer).__name__} was not set up with a module of {_OWNER}; pass it "
                "to fabric.setup(module, optimizer)"
            )
        if kwargs.get("closure") is not None:
            raise TypeError(
                f"{_OWNER} runs optimizer.step() on the master weights later (on the optimizer "
                "thread), where a closure cannot re-evaluate the loss; call opt.step() without one"
            )
        kwargs.pop("closure", None)
        real_zero_grad = run.real_zero_grad[id(raw)]
        run.reduce(raw)  # several nodes: the master gradients, reduced over the nodes
        # the hyperparameters of now: a scheduler may change them before the step runs
        queued = QueuedStep(raw) if self.async_step else None

        def step_fn() -> None:
            if queued is not None:
                queued.run(**kwargs)
            else:
                raw.step(**kwargs)
            real_zero_grad(set_to_none=True)
            run.dp.after_step(raw)  # sharded: all-gather the weights each node stepped

        run.step_queued()
        run.rp.step(step_fn, is_async=self.async_step)

    def _synchronize(self) -> None:
        for run in self._runs:
            run.rp.synchronize()

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        # the master gradients of pending iterations enter .grad first
        self._synchronize()
        run = self._reduce_for_clipping(optimizer)
        if run is not None and run.sharding(optimizer) is not None:
            return run.clip_sharded(optimizer, max_norm, norm_type, error_if_nonfinite)
        return super().clip_gradients_norm(
            module, optimizer, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    @override
    def clip_gradients_value(
        self, module: nn.Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        self._synchronize()
        self._reduce_for_clipping(optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    def _reduce_for_clipping(self, optimizer: Any) -> FabricRun | None:
        """Several nodes: reduce ``optimizer``'s gradients now (clipping reads reduced
        gradients, as under DDP); returns its run (None: not set up here)."""
        run = self._run_of(optimizer)
        raw = run.owns(optimizer) if run is not None else None
        if run is None or raw is None:
            return None
        run.reduce(raw)
        return run

    # -- checkpoints -------------------------------------------------------------------------
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        run = self._run_of(module)
        if run is None:
            return super().get_module_state_dict(module)
        run.rp.synchronize()
        return run.module.state_dict()

    @override
    def load_module_state_dict(
        self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True
    ) -> None:
        run = self._run_of(module)
        if run is None:
            super().load_module_state_dict(module, state_dict, strict=strict)
        else:
            run.load_state(state_dict, strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        run = self._run_of(optimizer)
        if run is not None:
            run.rp.synchronize()  # the step in flight writes the state
            shard = run.sharding(optimizer)
            if shard is not None:  # each node writes its own share (save_checkpoint)
                return marker(shard.world_size)
        return super().get_optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Fabric's save, plus ``checkpoint["roundpipe"][key]`` for each set-up module
        under ``key``: its higher-precision masters and layer timings. Sharded
        (``shard_host_state=True`` on several nodes), every node writes its share of the
        optimizer under ``key`` into ``<path>.shards/key/``; the file holds a marker."""
        self._synchronize()
        checkpoint = self._convert_stateful_objects_in_state(state, filter=filter or {})
        for key, obj in state.items():
            run = self._run_of(obj) if isinstance(obj, Optimizer) else None
            if run is not None:
                run.save_shard(fabric_shards_dir(path, key), obj)  # (a no-op unsharded)
        sections = {}
        for key, obj in state.items():
            run = self._run_of(obj) if isinstance(obj, nn.Module) else None
            if run is not None:
                sections[key] = run.section()
        if sections:
            if CHECKPOINT_KEY in checkpoint:
                raise ValueError(
                    f"fabric.save(): the state key {CHECKPOINT_KEY!r} is where {_OWNER} keeps its "
                    "master weights; save your entry under another name"
                )
            checkpoint[CHECKPOINT_KEY] = sections
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(
                checkpoint=checkpoint, path=path, storage_options=storage_options
            )

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Fabric's load; a set-up module's masters follow its weights (or come from
        ``checkpoint["roundpipe"]`` where they were saved in a higher precision), and the
        optimizers run fused again. An optimizer state saved sharded is read from its
        shards on any node count (sharded, each node keeps what it owns now)."""
        self._synchronize()
        # the set-up optimizers are restored here, after the modules: their state may be
        # a marker whose shards lie beside the file
        ours = {}
        if isinstance(state, Mapping):
            for key, obj in state.items():
                run = self._run_of(obj) if isinstance(obj, Optimizer) else None
                if run is not None:
                    ours[key] = (run, obj)
        if ours:
            assert isinstance(state, Mapping)
            rest = {k: v for k, v in state.items() if k not in ours}
            remainder = super().load_checkpoint(
                path, state=rest or None, strict=strict, weights_only=weights_only
            )
            if isinstance(state, dict):
                state.update(rest)  # plain entries were restored into the copy
        else:
            remainder = super().load_checkpoint(
                path, state=state, strict=strict, weights_only=weights_only
            )
        for key, (run, obj) in ours.items():
            if key not in remainder:
                if strict:
                    raise KeyError(f"fabric.load(): the checkpoint {path} has no {key!r}")
                continue
            run.load_optimizer(fabric_shards_dir(path, key), obj, remainder.pop(key))
        if isinstance(state, Mapping) and state and CHECKPOINT_KEY not in state:
            sections = remainder.pop(CHECKPOINT_KEY, None) or {}
            for key, obj in state.items():
                run = self._run_of(obj) if isinstance(obj, nn.Module) else None
                if run is not None:
                    run.load_section(sections.get(key), strict)
        if self.fuse_optimizer:
            # a checkpoint of an unfused run brings back fused=None with its param groups
            for run in self._runs:
                for opt in run.optimizers:
                    fuse_optimizer(opt)
        return remainder

    # -- end ---------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Finish every step, stop the RoundPipes' threads and undo what setup installed
        (the modules then hold the trained weights)."""
        try:
            while self._runs:
                run = self._runs.pop()
                run.dp.detach()  # its groups; the default process group stays
                run.close()
        finally:
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="RoundPipe pipelined training (Fabric)"
        )


if RoundPipeFabricStrategy.strategy_name not in STRATEGY_REGISTRY:
    RoundPipeFabricStrategy.register_strategies(STRATEGY_REGISTRY)
