"""``RoundPipeStrategy``: train a LightningModule's ``nn.Sequential`` with RoundPipe.

The LightningModule returns its network from ``configure_sequential()``; at
setup the strategy wraps it in a RoundPipe whose device pool is the Trainer's
devices (``accelerator="cpu", devices=N``: N CPU workers; ``accelerator="gpu",
devices=N``: N GPUs), all in this one process, and sets
``lightning_module.roundpipe``.

How Lightning's training loop maps onto RoundPipe:

* ``training_step`` calls ``self.roundpipe.forward_backward(...)``, which
  already backpropagated into the fp32 master gradients; the strategy's
  ``backward`` is a no-op for such a (detached) loss and a normal backward for
  a loss built from ``self.roundpipe(x)`` (autograd through the pipeline).
* ``configure_optimizers`` is written as usual (``AdamW(self.parameters())``);
  the strategy swaps every model parameter in the optimizer for its master
  copy, so the optimizer state is fp32 and lives on the host.
* The optimizer step is ``roundpipe.step(step_fn, is_async=async_step)``.
  Everything that looks at gradients -- ``on_before_optimizer_step``, loss-scale
  unscaling, gradient clipping -- runs on the main thread right before it,
  when the window's gradients are complete; ``step_fn`` (on RoundPipe's
  optimizer thread) runs ``optimizer.step()`` and clears the gradients.
  Lightning's own ``zero_grad`` calls are therefore no-ops: in automatic
  optimization Lightning zeroes *after* ``training_step``, which would wipe the
  gradients ``forward_backward`` just produced.
* ``accumulate_grad_batches=k``: every microbatch loss is multiplied by
  ``1/k`` (as Lightning divides the loss), gradients accumulate in the master
  ``.grad`` over the window and one RoundPipe step follows.

Data parallelism over several processes (one per node, issue 7) grows from
``ParallelStrategy``: cluster environment, world ranks and the distributed
sampler are already wired; collectives use ``torch.distributed`` when a process
group exists and are identities otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

from ._engine import LightningRoundPipe
from .checkpoint_io import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_KEY,
    StreamingCheckpointIO,
    check_roundpipe_section,
)
from .distributed import DataParallel
from .plans import resolve_execute_plan
from .precision import (
    DynamicLossScaler,
    PrecisionMode,
    install_autocast,
    remove_hooks,
    resolve_precision,
)

log = logging.getLogger(__name__)

_MISSING = object()

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "double": torch.float64,
}


def _parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.float32`` or a name ("float32", "torch.bfloat16", "bf16") -> dtype (YAML/CLI friendly)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(
            f"optim_dtype={value!r} is not a floating dtype name; use e.g. 'float32', 'bfloat16' or 'float16'"
        )
    raise TypeError(
        f"optim_dtype must be a torch.dtype, a dtype name or None, got {type(value).__name__}"
    )


class RoundPipeStrategy(ParallelStrategy):
    """Run a LightningModule's ``configure_sequential()`` network with RoundPipe.

    Args:
        num_microbatch: microbatches per pipelined call (default: devices + 1).
        execute_plan: the stage plan of ``forward_backward``: ``None`` (the engine's
            default), ``"auto"`` (``ModelExecutePlan.auto`` at setup), a
            ``ModelExecutePlan``, a layout string such as ``"fwd=3,2 bwd=1,2,2,1"``
            (see :func:`roundpipe_lightning.plans.resolve_execute_plan`) or a dict of
            ``ModelExecutePlan.from_layout`` arguments.
        optim_dtype: dtype of the optimizer's master weights (default fp32; a name
            such as ``"float32"`` works too, for YAML configs). ``None``: the model's dtype.
        pin_model: host memory of the parameters on CUDA ("alloc", "register", "off").
        async_step: overlap the optimizer step with the next iteration (weights one
            step stale, as in RoundPipe). ``False``: the same computation as plain PyTorch.
        recompute_grain: "stage" or "layer" (None: the engine's default).
        preserve_rng_state: replay the forward's RNG in recompute (dropout masks).
        model_run_config: further ``RoundPipeRunConfig`` defaults; the explicit
            arguments above take precedence over its fields.
        grad_reduce_op: with several processes (``num_nodes``), "mean" (as DDP) or
            "sum" of the master gradients over processes.
        overlap_grad_reduce: start all-reducing a bucket of gradients as soon as its
            layers' backward is done, while earlier layers still compute.
        process_group_timeout: seconds after which a collective whose peer died fails
            (default ``$ROUNDPIPE_DIST_TIMEOUT`` or 30 minutes).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for any Lightning ``ParallelStrategy`` (normally left to the Trainer).
    """

    strategy_name = "roundpipe"

    def __init__(
        self,
        num_microbatch: int | None = None,
        execute_plan: ModelExecutePlan | str | dict | None = None,
        optim_dtype: torch.dtype | str | None = torch.float32,
        pin_model: str = "alloc",
        async_step: bool = True,
        recompute_grain: str | None = None,
        preserve_rng_state: bool = True,
        model_run_config: RoundPipeRunConfig | None = None,
        grad_reduce_op: str = "mean",
        overlap_grad_reduce: bool = True,
        process_group_timeout: float | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if num_microbatch is not None and (
            not isinstance(num_microbatch, int)
            or isinstance(num_microbatch, bool)
            or num_microbatch < 1
        ):
            raise ValueError(
                f"num_microbatch must be a positive int or None, got {num_microbatch!r}"
            )
        if pin_model not in ("alloc", "register", "off"):
            raise ValueError(f"pin_model must be 'alloc', 'register' or 'off', got {pin_model!r}")
        if recompute_grain is not None and recompute_grain not in ("stage", "layer"):
            raise ValueError(
                f"recompute_grain must be 'stage', 'layer' or None, got {recompute_grain!r}"
            )
        if model_run_config is not None and not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError(
                f"model_run_config must be a roundpipe_core.RoundPipeRunConfig, got {type(model_run_config).__name__}"
            )
        if execute_plan is not None and not isinstance(
            execute_plan, (ModelExecutePlan, str, Mapping)
        ):
            raise TypeError(
                "execute_plan must be None, 'auto', a ModelExecutePlan, a layout string or a dict of "
                f"ModelExecutePlan.from_layout arguments, got {type(execute_plan).__name__}"
            )
        self.num_microbatch = num_microbatch
        self.execute_plan = execute_plan
        self.optim_dtype = _parse_dtype(optim_dtype)
        self.pin_model = pin_model
        self.async_step = bool(async_step)
        self.recompute_grain = recompute_grain
        self.preserve_rng_state = bool(preserve_rng_state)
        self.model_run_config = model_run_config
        self._num_nodes = 1
        self._rp: LightningRoundPipe | None = None
        self._rp_open = False
        self._precision_mode: PrecisionMode | None = None
        self._loss_scaler: DynamicLossScaler | None = None
        self._hook_handles: list[Any] = []
        self._real_zero_grad: dict[int, Callable[..., None]] = {}
        self._in_training_step = False
        self._failed = False
        self._previous_attr: Any = _MISSING
        # one process per node, data parallel over torch.distributed (no-ops in one process)
        self._dp = DataParallel(
            op=grad_reduce_op, overlap=overlap_grad_reduce, timeout=process_group_timeout
        )

    # -- topology (single process now; one process per node later) ---------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def root_device(self) -> torch.device:
        # Model state, batches and losses live on the host; the pool's devices are
        # RoundPipe's business.
        return torch.device("cpu")

    @property
    def compute_devices(self) -> list[torch.device]:
        """The devices of this process's RoundPipe pool (the Trainer's ``devices``)."""
        return list(self.parallel_devices or [torch.device("cpu")])

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # One process per node: the node's whole pool consumes one shard.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank)
            self.cluster_environment.set_world_size(self.num_nodes)
        rank_zero_only.rank = self.global_rank

    def model_to_device(self) -> None:
        # Parameters stay in host memory; RoundPipe uploads stages to its devices.
        return None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Master weights exist only once RoundPipe is built in setup().
        return True

    # -- collectives (identities in one process) ------------------------------------------------
    def _dist_ready(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor) and self._dist_ready():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if self._dist_ready():
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not self._dist_ready():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # -- setup ------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        # Fail on an unsupported configuration before anything starts.
        self._precision_mode = resolve_precision(self.precision_plugin)
        if self.world_size > 1:
            env = self.cluster_environment
            if env is None or not env.creates_processes_externally:
                raise ValueError(
                    f"RoundPipeStrategy with num_nodes={self.num_nodes} runs one process per node, started "
                    "by a launcher: torchrun (--nnodes N --nproc-per-node 1), SLURM (srun, one task per node) "
                    "or the MASTER_ADDR / MASTER_PORT / WORLD_SIZE / NODE_RANK / LOCAL_RANK=0 environment. "
                    "This process was not started that way."
                )
            self._dp.connect(env, self.world_size)
        devices = self.compute_devices
        kinds = {d.type for d in devices}
        if not kinds <= {"cpu", "cuda"} or len(kinds) != 1:
            raise ValueError(
                f"RoundPipeStrategy runs on CPU workers or CUDA GPUs, got devices {devices}; "
                "use Trainer(accelerator='cpu' or 'gpu', devices=N)"
            )
        assert self.accelerator is not None
        self.accelerator.setup_device(devices[0])

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._precision_mode = resolve_precision(self.precision_plugin)
        assert self.model is not None
        # Half-precision plugins cast the module here, before RoundPipe copies fp32 masters.
        self.model = self.precision_plugin.convert_module(self.model)
        self._build_roundpipe()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # every process starts from rank 0's weights; one gradient reducer per optimizer
            self._dp.attach(self.roundpipe, self.optimizers)
        self.setup_precision_plugin()

    def _sequential_of(self, lm: LightningModule) -> tuple[nn.Module, Any]:
        """Call ``configure_sequential()`` and check what it returned."""
        hook = getattr(lm, "configure_sequential", None)
        if hook is None or not callable(hook):
            raise TypeError(
                f"{type(lm).__name__} has no configure_sequential() method, which RoundPipeStrategy needs. "
                "Add one that returns the network as an nn.Sequential of layers, e.g.\n"
                "    def configure_sequential(self):\n"
                "        return self.net  # nn.Sequential(embedding, block, ..., head)"
            )
        net = hook()
        if isinstance(net, RoundPipe):
            raise TypeError(
                "configure_sequential() returned a RoundPipe; return the plain nn.Sequential (or "
                "Hugging Face model) instead -- RoundPipeStrategy wraps it and sets self.roundpipe"
            )
        if not isinstance(net, nn.Module):
            raise TypeError(
                f"configure_sequential() must return an nn.Module (an nn.Sequential of layers), got "
                f"{type(net).__name__}"
            )
        if net is lm:
            raise ValueError(
                "configure_sequential() returned the LightningModule itself; return the network "
                "submodule (e.g. self.net), an nn.Sequential of layers"
            )
        if not any(m is net for m in lm.modules()):
            raise ValueError(
                "configure_sequential() must return a submodule of the LightningModule (assign it in "
                "__init__, e.g. self.net = nn.Sequential(...), and return self.net) so that its weights "
                "are part of the module's state_dict and its checkpoints"
            )
        if isinstance(net, nn.Sequential):
            if len(net) == 0:
                raise ValueError(
                    "configure_sequential() returned an empty nn.Sequential; give it layers"
                )
            return net, None
        from roundpipe_core.presets import convert_to_sequential, find_preset, unwrap_peft

        if find_preset(unwrap_peft(net)) is not None:
            return convert_to_sequential(net), net
        rank_zero_warn(
            f"configure_sequential() returned a {type(net).__name__}, not an nn.Sequential and no preset "
            "converts it: RoundPipe runs it as a single layer (no pipelining). Return an nn.Sequential of "
            "layers to pipeline it."
        )
        return net, None

    def _build_roundpipe(self) -> None:
        lm = self.lightning_module
        assert lm is not None
        self._close_roundpipe()
        seq, original = self._sequential_of(lm)
        cfg = self.model_run_config or RoundPipeRunConfig()
        overrides = {
            "num_microbatch": self.num_microbatch,
            "recompute_grain": self.recompute_grain,
            "preserve_rng_state": self.preserve_rng_state,
        }
        cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
        devices = self.compute_devices
        pool_arg: Any = f"cpu:{len(devices)}" if devices[0].type == "cpu" else devices
        rp = LightningRoundPipe(
            seq,
            optim_dtype=self.optim_dtype,
            name=type(lm).__name__,
            model_run_config=cfg,
            pin_model=self.pin_model,
            devices=pool_arg,
            original_model=original,
        )
        self._rp, self._rp_open = rp, True
        try:
            plan = resolve_execute_plan(self.execute_plan, rp, "fused")
            if plan is not None:
                rp.set_plan("fused", plan)
            mode = self._precision_mode
            assert mode is not None
            if mode.autocast_dtype is not None:
                self._hook_handles = install_autocast(rp.layers, mode.autocast_dtype)
            self._loss_scaler = (
                DynamicLossScaler.from_plugin(self.precision_plugin) if mode.loss_scaling else None
            )
            rp.loss_multiplier = self._loss_multiplier
        except BaseException:
            self._close_roundpipe()
            raise
        # Not a registered submodule: the LightningModule's state_dict keeps its own names only.
        # A value the module had under that name (e.g. ``self.roundpipe = None``) comes back at teardown.
        self._previous_attr = lm.__dict__.get("roundpipe", _MISSING)
        object.__setattr__(lm, "roundpipe", rp)

    @property
    def roundpipe(self) -> LightningRoundPipe:
        """The RoundPipe of the current run (after setup)."""
        if self._rp is None:
            raise RuntimeError(
                "RoundPipeStrategy has no RoundPipe yet; it is built when the Trainer runs"
            )
        return self._rp

    def _loss_multiplier(self) -> float:
        """Factor on each microbatch loss inside ``forward_backward`` (see the module docstring)."""
        if not self._in_training_step:
            return 1.0
        factor = 1.0
        lm = self.lightning_module
        if lm is not None and lm.automatic_optimization and lm._trainer is not None:
            factor /= lm.trainer.accumulate_grad_batches
        if self._loss_scaler is not None:
            factor *= self._loss_scaler.scale
        return factor

    # -- optimizers ---------------------------------------------------------------------------------
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            self._adopt_optimizer(opt._optimizer if isinstance(opt, LightningOptimizer) else opt)

    def _adopt_optimizer(self, opt: Optimizer) -> None:
        """Point ``opt`` at the master copies and defer its ``zero_grad`` to the RoundPipe step."""
        if isinstance(opt, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS re-evaluates the loss inside optimizer.step(), which RoundPipe's (asynchronous) "
                "step cannot do; choose another optimizer"
            )
        rp = self.roundpipe
        masters = {}
        for p in rp.model.parameters():
            m = rp.master_param(p)
            if m is not None:
                masters[id(p)] = m
        adopted = 0
        for group in opt.param_groups:
            new, seen = [], set()
            for p in group["params"]:
                m = masters.get(id(p), p)
                adopted += m is not p
                if id(m) not in seen:
                    seen.add(id(m))
                    new.append(m)
            group["params"] = new
        if adopted == 0 and any(len(g["params"]) for g in opt.param_groups) and masters:
            rank_zero_warn(
                f"{type(opt).__name__} holds none of the parameters of configure_sequential()'s network; "
                "RoundPipe will not train it. Build it from self.parameters()."
            )
        if id(opt) not in self._real_zero_grad:
            self._real_zero_grad[id(opt)] = opt.zero_grad

            def deferred_zero_grad(set_to_none: bool = True) -> None:
                """Gradients are cleared by the RoundPipe step right after the update."""

            opt.zero_grad = deferred_zero_grad  # type: ignore[method-assign]

    def _release_optimizers(self) -> None:
        for opt in self.optimizers:
            raw = opt._optimizer if isinstance(opt, LightningOptimizer) else opt
            if id(raw) in self._real_zero_grad and "zero_grad" in vars(raw):
                del raw.zero_grad
        self._real_zero_grad.clear()

    # -- training --------------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_training_step = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._in_training_step = False

    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """A no-op for a ``forward_backward`` loss (already backpropagated); a normal backward
        for a loss with a graph (e.g. built from ``self.roundpipe(x)``)."""
        lm = self.lightning_module
        assert lm is not None
        self.pre_backward(closure_loss)
        # The base Precision hooks only call on_before/after_backward; AMP loss scaling is ours.
        Precision.pre_backward(self.precision_plugin, closure_loss, lm)
        if closure_loss.requires_grad:
            loss = closure_loss
            if self._loss_scaler is not None:
                loss = loss * self._loss_scaler.scale
            lm.backward(loss, *args, **kwargs)
        closure_loss = Precision.post_backward(self.precision_plugin, closure_loss, lm)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (training_step), prepare the master gradients on this thread
        (hooks, unscaling, clipping), then hand ``optimizer.step()`` to RoundPipe."""
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        rp = self.roundpipe
        # (several processes: the closure's backward starts all-reducing finished layers)
        closure_result = self._dp.wrap_closure(opt, closure)()
        skip = closure_result is None and model.automatic_optimization
        # Wait for the previous step (rp.step would do the same first): from here on the
        # master gradients of this window are complete and nothing else touches them.
        rp.synchronize()
        self.reduce_gradients(opt)
        found_inf = False
        if self._loss_scaler is not None and not skip:
            found_inf = self._loss_scaler.unscale_(p for g in opt.param_groups for p in g["params"])
        # on_before_optimizer_step hooks + gradient clipping (automatic optimization)
        self.precision_plugin._after_closure(model, opt)
        if self._loss_scaler is not None and not skip:
            self._loss_scaler.update(found_inf)
        do_update = not (skip or found_inf)
        zero_grad = self._real_zero_grad.get(id(opt), opt.zero_grad)

        def step_fn() -> None:
            if do_update:
                opt.step(**kwargs)
            zero_grad(set_to_none=True)

        rp.step(step_fn, is_async=self.async_step)
        return closure_result

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Combine the window's master gradients across processes (all-reduce over gloo)
        before they are unscaled, clipped and stepped. Collective: every process calls it
        for every optimizer step, skipped ones included. One process: nothing to do."""
        self._dp.reduce(optimizer)

    # -- evaluation sees the current weights --------------------------------------------------------
    def _sync_weights(self) -> None:
        if self._rp is not None and self._rp_open:
            self._rp.synchronize()

    def on_validation_start(self) -> None:
        self._sync_weights()

    def on_test_start(self) -> None:
        self._sync_weights()

    def on_predict_start(self) -> None:
        self._sync_weights()

    def on_train_end(self) -> None:
        self._sync_weights()

    # -- checkpoints ------------------------------------------------------------------------------------
    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Streaming, atomic saves and memory-mapped loads (:class:`StreamingCheckpointIO`)
        unless a ``checkpoint_io`` was passed to the strategy or the Trainer's plugins."""
        if self._checkpoint_io is None:
            self._checkpoint_io = StreamingCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            # an AsyncCheckpointIO without its own inner IO (the setter keeps a configured one)
            self._checkpoint_io.checkpoint_io = StreamingCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._sync_weights()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        self._sync_weights()
        return super().optimizer_state(optimizer)

    def _named_masters(self) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """(LightningModule parameter name, model parameter, master) for every trainable parameter."""
        rp, lm = self._rp, self.lightning_module
        if rp is None or lm is None:
            return []
        out = []
        for name, p in lm.named_parameters():
            m = rp.master_param(p)
            if m is not None:
                out.append((name, p, m))
        return out

    def roundpipe_state_dict(self) -> dict[str, Any]:
        """What the strategy adds to a checkpoint under ``checkpoint["roundpipe"]``:
        master weights that differ in dtype from the model's (fp32 masters of a
        half-precision model), the loss scaler and the layer timer.

        The masters are the live tensors, not copies (host memory holds one of each):
        the step is drained here and nothing updates them until the save returns."""
        self._sync_weights()
        masters = {name: m.detach() for name, p, m in self._named_masters() if m.dtype != p.dtype}
        state: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "masters": masters}
        if self._loss_scaler is not None:
            state["loss_scaler"] = self._loss_scaler.state_dict()
        if self._rp is not None:
            state["timer"] = self._rp.model_timer.state_dict()
        return state

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        if self._rp is not None:
            checkpoint[CHECKPOINT_KEY] = self.roundpipe_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._sync_weights()
        section = checkpoint.get(CHECKPOINT_KEY)
        # checked before anything is loaded, so a bad file leaves the model as it was
        params = {name: p for name, p, _ in self._named_masters()}
        saved = check_roundpipe_section(section, params, strict=strict)
        state = section or {}
        super().load_model_state_dict(checkpoint, strict=strict)
        with torch.no_grad():
            for name, p, m in self._named_masters():
                src = saved.get(name)
                m.copy_(src if src is not None else p)
                m.grad = None
        if self._loss_scaler is not None and "loss_scaler" in state:
            self._loss_scaler.load_state_dict(state["loss_scaler"])
        if self._rp is not None and "timer" in state:
            try:
                self._rp.model_timer.load_state_dict(state["timer"])
            except ValueError as exc:
                rank_zero_warn(
                    f"RoundPipe layer timings in the checkpoint were not restored: {exc}"
                )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._sync_weights()
        super().load_optimizer_state_dict(checkpoint)

    # -- teardown --------------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        self._dp.abort()

    def _close_roundpipe(self) -> None:
        """Finish the in-flight step, stop the worker threads, undo what setup installed."""
        rp = self._rp
        if rp is None or not self._rp_open:
            return
        self._rp_open = False
        try:
            rp.close()
        except BaseException as exc:
            if not self._failed:
                raise
            log.debug("RoundPipe.close() after a failure raised: %r", exc)
        finally:
            remove_hooks(self._hook_handles)
            rp.loss_multiplier = None
            lm = self.lightning_module
            if lm is not None and lm.__dict__.get("roundpipe") is rp:
                object.__delattr__(lm, "roundpipe")
                if self._previous_attr is not _MISSING:
                    object.__setattr__(lm, "roundpipe", self._previous_attr)
            self._previous_attr = _MISSING

    def teardown(self) -> None:
        try:
            self._dp.detach()
            self._close_roundpipe()
        finally:
            self._release_optimizers()
            self._failed = False
            # ParallelStrategy.teardown: cluster environment, optimizers/model to CPU, plugins.
            super().teardown()

    # -- registry -------------------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="RoundPipe pipelined training"
        )


if RoundPipeStrategy.strategy_name not in StrategyRegistry:
    RoundPipeStrategy.register_strategies(StrategyRegistry)
