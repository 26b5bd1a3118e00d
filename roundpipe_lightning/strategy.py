"""``RoundPipeStrategy``: train a LightningModule's ``nn.Sequential`` with RoundPipe.

At setup the strategy wraps what ``configure_sequential()`` returns in a plain ``RoundPipe``
whose pool is the Trainer's devices (``accelerator="cpu", devices=N``: N CPU workers; ``"gpu"``:
N GPUs), in this one process, and sets ``lightning_module.roundpipe``. It composes the engine
through its hooks: ``loss_multiplier`` (``1/accumulate_grad_batches`` times the loss scale),
``set_plan`` (layouts, ``AutoReplan``) and the caller's autocast state, which the engine carries
to its worker threads.

* ``training_step`` calls ``self.roundpipe.forward_backward(...)`` (any of the
  engine's arguments, ``blocking=False`` included): it already backpropagated
  into the fp32 master gradients, so its backward is a no-op; a loss built from
  ``self.roundpipe(x)`` is backpropagated through the pipeline as usual.
* The optimizer built in ``configure_optimizers`` is pointed at the masters; its step is
  ``roundpipe.step(step_fn, is_async=async_step)``. Everything that looks at gradients (reduction
  over processes, unscaling, ``on_before_optimizer_step``, clipping) runs on the main thread first
  (:class:`RoundPipePrecision`); ``step_fn`` runs ``optimizer.step()`` with the hyperparameters of
  the moment it was queued, then clears the gradients (Lightning's ``zero_grad`` is a no-op).
* With ``async_step=True`` the weights are flushed before every hook where users
  read them: epoch and training end, validation / test / predict start, checkpoints.
* With ``async_step=True`` (and ``overlap_iterations=True``, the default) iterations
  overlap: ``training_step``'s ``forward_backward`` is issued non-blocking through the
  engine's ``forward_backward_hook`` and returns a lazily resolved loss
  (``docs/lightning.md``, "Overlapped iterations", says when its value is read).

Several processes (one per node) are data parallel over ``torch.distributed``
(:mod:`roundpipe_core.distributed`); collectives are identities in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from roundpipe_core import AutoRoundPipe, ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core import distributed as D
from roundpipe_core.loss import LOSS_REDUCTIONS
from roundpipe_core.running.host_memory import available_host_memory, check_host_memory

from ._checkpointing import CheckpointingStrategy
from ._flush import FlushWeights
from ._private import mark_lr_scheduler_step_called
from ._run_state import RunState
from ._setup import (
    adopt_optimizer,
    build_roundpipe,
    check_bool,
    check_choice,
    check_loss_went_through,
    check_num_microbatch,
    check_plugins,
    check_pool_devices,
    check_shardable,
    check_step_request,
    check_type,
    fuse_optimizer,
    host_memory_budget,
    order_manual_zero_grad,
    parse_dtype,
    raw_optimizer,
    release_optimizers,
    sequential_of,
    setup_summary,
    trainer_of,
    user_impl_choice,
)
from ._step import (
    OverlappedForwardBackward,
    QueuedStep,
    in_order,
    overlap_blocker,
    steps_in_parts,
)
from .checkpoint_io import CHECKPOINT_FORMAT, CHECKPOINT_KEY
from .precision import LossScaler, RoundPipePrecision

__all__ = ["RoundPipeStrategy", "CHECKPOINT_KEY", "CHECKPOINT_FORMAT"]

log = logging.getLogger(__name__)

_MISSING = object()


class RoundPipeStrategy(CheckpointingStrategy):
    """Run a LightningModule's ``configure_sequential()`` network with RoundPipe.

    Args:
        loss_reduction: how ``self.roundpipe.forward_backward`` combines its microbatch
            losses (``RoundPipe.loss_reduction``). ``"mean"`` (default): each is weighted by
            its share of the batch, so a ``loss_fn`` returning a batch mean
            (``F.cross_entropy``) gives plain Lightning's loss and gradients, whatever the
            microbatch count. ``"sum"``: RoundPipe's published contract, the losses added up.
        num_microbatch: microbatches per pipelined call (default: the engine's,
            :func:`~roundpipe_core.planning.plan.default_num_microbatch`: devices + 1 on
            GPUs; on CPU workers 1, or one per worker where the one-stage plan runs on
            every worker at once -- the default for a model without buffers).
        execute_plan: the stage plan of ``forward_backward``: ``None`` (the engine's
            default), ``"auto"`` (``ModelExecutePlan.auto`` at setup), a
            ``ModelExecutePlan``, a layout string such as ``"fwd=3,2 bwd=1,2,2,1"``
            (see :func:`roundpipe_lightning.plans.resolve_execute_plan`) or a dict of
            ``ModelExecutePlan.from_layout`` arguments.
        optim_dtype: dtype of the optimizer's master weights (default fp32; a name
            such as ``"float32"`` works too, for YAML configs). ``None``: the model's dtype.
        pin_model: host memory of the parameters on CUDA ("alloc", "register", "off").
        async_step: overlap the optimizer step with the next iteration (weights one
            step stale, as in RoundPipe). ``False``: the same computation as plain PyTorch,
            and parameters already in ``optim_dtype`` (an fp32 module) are their own
            masters (``RoundPipe(shared_masters=True)``): one copy of the weights in host
            memory instead of two, the same numbers. ``None`` (the default) follows the
            hardware: ``True`` on GPUs, where the host step runs beside the devices;
            ``False`` on CPU workers, where the optimizer thread would compete with the
            workers for the same cores (slower, and one step stale for nothing).
        fuse_optimizer: run the optimizers of ``configure_optimizers`` on torch's fused
            CPU kernel (Adam, AdamW, SGD, Adagrad) when they were built without a
            ``fused`` / ``foreach`` choice: switched in place at setup, the same update
            within fp32 rounding, several times faster on the host. ``False``: as built.
        overlap_iterations: with ``async_step=True``, ``training_step``'s
            ``self.roundpipe.forward_backward(...)`` runs non-blocking and returns a lazy
            loss (see the module docstring for when it is computed). Same numbers as
            ``False``. ``blocking=True`` passed to ``forward_backward`` is respected.
        recompute_grain: "stage" or "layer" (None: the engine's default).
        preserve_rng_state: replay the forward's RNG in recompute (dropout masks).
        model_run_config: further ``RoundPipeRunConfig`` defaults; the explicit
            arguments above take precedence over its fields.
        grad_reduce_op: with several processes (``num_nodes``), "mean" (as DDP) or
            "sum" of the master gradients over processes.
        overlap_grad_reduce: start all-reducing a bucket of gradients as soon as its
            layers' backward is done, while earlier layers still compute.
        process_group_timeout: seconds (or a ``timedelta``) after which a collective
            whose peer died fails (default ``$ROUNDPIPE_DIST_TIMEOUT`` or 30 minutes).
        shard_host_state: with several processes, each keeps gradients, optimizer state and
            masters for its 1/N of the parameters (``docs/multi-node.md``).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for any Lightning ``ParallelStrategy`` (normally left to the Trainer). The
            precision plugin becomes a :class:`~roundpipe_lightning.precision.RoundPipePrecision`.

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
        overlap_iterations: bool = True,
        recompute_grain: str | None = None,
        preserve_rng_state: bool = True,
        model_run_config: RoundPipeRunConfig | None = None,
        grad_reduce_op: str = "mean",
        overlap_grad_reduce: bool = True,
        process_group_timeout: float | timedelta | None = None,
        shard_host_state: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self._default_precision = RoundPipePrecision()
        check_plugins(checkpoint_io, precision_plugin)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.loss_reduction = check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        check_choice("pin_model", pin_model, ("alloc", "register", "off"))
        check_choice("recompute_grain", recompute_grain, ("stage", "layer", None))
        check_choice("grad_reduce_op", grad_reduce_op, ("mean", "sum"))
        check_type(
            "model_run_config", model_run_config, (RoundPipeRunConfig,), "a RoundPipeRunConfig"
        )
        check_type(
            "execute_plan",
            execute_plan,
            (ModelExecutePlan, str, Mapping),
            "'auto', a ModelExecutePlan, a layout string or a dict of from_layout arguments",
        )
        self.num_microbatch = check_num_microbatch(num_microbatch)
        self.execute_plan = execute_plan
        self.optim_dtype = parse_dtype(optim_dtype)
        self.pin_model = pin_model
        self._async_request = check_step_request(async_step, "RoundPipeStrategy")
        self.fuse_optimizer = check_bool("fuse_optimizer", fuse_optimizer)
        self.overlap_iterations = check_bool("overlap_iterations", overlap_iterations)
        self.recompute_grain = recompute_grain
        self.preserve_rng_state = check_bool("preserve_rng_state", preserve_rng_state)
        self.model_run_config = model_run_config
        self._num_nodes = 1
        self._rp: RoundPipe | AutoRoundPipe | None = None
        # phase, overlap, and the steps in flight and lost: one object, not six flags
        self._run = RunState()
        self._real_zero_grad: dict[int, Callable[..., None]] = {}
        self._zero_grad_wrappers: list[Any] = []  # LightningOptimizers (manual optimization)
        self._user_impl: dict[int, list[dict[str, Any]]] = {}  # fused / foreach as built: saved
        self._previous_attr: Any = _MISSING
        self._flush_callback = FlushWeights(self._sync_weights)
        try:
            # one process per node, data parallel over torch.distributed (no-ops in one process)
            self._dp = D.DataParallel(
                op=grad_reduce_op,
                overlap=check_bool("overlap_grad_reduce", overlap_grad_reduce),
                timeout=process_group_timeout,
                shard_host_state=check_bool("shard_host_state", shard_host_state),
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"RoundPipeStrategy: {exc}") from None

    @property
    def async_step(self) -> bool:
        """Whether the optimizer step overlaps the next iteration: as given, or, for
        ``async_step=None``, whether the pool's devices are GPUs (CPU workers: no)."""
        if self._async_request is not None:
            return self._async_request
        return self.compute_devices[0].type != "cpu"

    # -- precision ---------------------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> RoundPipePrecision:
        plugin = self._precision_plugin
        if plugin is None:
            return self._default_precision
        if not isinstance(plugin, RoundPipePrecision):
            # converted on first use, so that an unsupported plugin fails when the run starts
            plugin = self._precision_plugin = RoundPipePrecision.from_plugin(plugin)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # None stays None: Lightning treats a strategy that has a plugin as having been
        # given one, and would then refuse Trainer(precision=...) / plugins=[...]
        self._precision_plugin = plugin

    @property
    def _loss_scaler(self) -> LossScaler | None:
        """The loss scaler of ``16-mixed`` (None otherwise)."""
        return self.precision_plugin.scaler

    # -- setup ------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        # Fail on an unsupported configuration before anything starts.
        _ = self.precision_plugin
        env = self.check_launch()
        if self.world_size > 1:
            check_shardable(self._dp.shard_host_state, self._loss_scaler)
            self._dp.connect(env, self.world_size)
        devices = check_pool_devices(self.compute_devices)
        assert self.accelerator is not None
        self.accelerator.setup_device(devices[0])

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        # Half-precision plugins cast the module here, before RoundPipe copies fp32 masters.
        self.model = self.precision_plugin.convert_module(self.model)
        self._build_roundpipe()
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if self.async_step and self._flush_callback not in callbacks:
            # first: callback hooks run before the module's and the strategy's
            callbacks.insert(0, self._flush_callback)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # refuse, with numbers, a run whose state cannot fit in host memory
            opts = [raw_optimizer(o) for o in self.optimizers]
            budget = host_memory_budget(
                self.roundpipe, opts, self.num_microbatch, self._dp, self.async_step
            )
            available = available_host_memory()
            # as Lightning says its set-up facts ("GPU available: ..."): a few lines, the
            # whole budget table only at DEBUG (or from estimate_host_memory())
            rank_zero_info(
                setup_summary(
                    "RoundPipeStrategy",
                    self.roundpipe,
                    self.num_microbatch,
                    self.async_step,
                    self._async_request is not None,
                )
            )
            rank_zero_info(f"RoundPipeStrategy: {budget.summary(available)}")
            rank_zero_debug(f"RoundPipe host memory:\n{budget}")
            check_host_memory(budget, available)
            # every process starts from rank 0's weights; one gradient reducer per optimizer
            self._dp.attach(self.roundpipe, self.optimizers, async_step=self.async_step)
            sharded = self._dp.state_shards > 1  # clipping: the norm over every process's share
            self.precision_plugin.clip_norm_fn = self._dp.clip_grad_norm_ if sharded else None
        self.setup_precision_plugin()
        self._load_deferred_model_state()  # a checkpoint read before setup (fit(ckpt_path=...))

    def _build_roundpipe(self) -> None:
        lm = self.lightning_module
        assert lm is not None
        self._close_roundpipe()
        seq, original = sequential_of(lm)
        rp = build_roundpipe(
            seq,
            original,
            name=type(lm).__name__,
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
        )
        self._rp = rp
        self._run.open()
        try:
            if isinstance(rp, RoundPipe):  # (an AutoRoundPipe has no fused call to hook)
                rp.loss_multiplier = self._loss_multiplier
                if self.overlap_iterations:
                    rp.forward_backward_hook = OverlappedForwardBackward(
                        lambda: self._run.in_training_step and self._run.overlap,
                        self._pipeline_failed,
                    )
        except BaseException:
            self._close_roundpipe()
            raise
        # Not a registered submodule (the module's state_dict keeps its own names); a value it
        # had under that name (``self.roundpipe = None``) comes back at teardown.
        self._previous_attr = lm.__dict__.get("roundpipe", _MISSING)
        object.__setattr__(lm, "roundpipe", rp)

    @property
    def roundpipe(self) -> RoundPipe | AutoRoundPipe:
        """The RoundPipe of the current run (after setup)."""
        if self._rp is None:
            raise RuntimeError(
                "RoundPipeStrategy has no RoundPipe yet; it is built when the Trainer runs"
            )
        return self._rp

    def _loss_multiplier(self) -> float:
        """Factor on each microbatch loss inside ``forward_backward``: ``1/k`` for
        ``accumulate_grad_batches=k`` (as Lightning divides the loss) times the loss scale."""
        if not self._run.in_training_step:
            return 1.0
        factor = 1.0
        lm = self.lightning_module
        trainer = trainer_of(lm)
        if lm is not None and lm.automatic_optimization and trainer is not None:
            factor /= trainer.accumulate_grad_batches
        return factor * self.precision_plugin.loss_scale()

    # -- optimizers ---------------------------------------------------------------------------------
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self._user_impl = {id(raw_optimizer(o)): user_impl_choice(o) for o in self.optimizers}
        for opt in self.optimizers:
            adopt_optimizer(raw_optimizer(opt), self.roundpipe, self._real_zero_grad)
            if self.fuse_optimizer:
                # on the masters (host, fp32)
                fuse_optimizer(raw_optimizer(opt))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)  # (checks the state's shapes)
        if self.fuse_optimizer:
            # a checkpoint of an unfused run brings back fused=None with its param groups
            for opt in self.optimizers:
                fuse_optimizer(raw_optimizer(opt))

    # -- training --------------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._run.overlap = False
        lm = self.lightning_module
        if lm is not None and self._rp is not None and not lm.automatic_optimization:
            # at train start: Lightning re-creates its LightningOptimizers after setup
            self._zero_grad_wrappers += order_manual_zero_grad(lm, self._rp, self._real_zero_grad)
        self._check_optimizer_states()  # also state a hook loaded, before the first step
        if not self.overlap_iterations or not isinstance(self._rp, RoundPipe) or lm is None:
            return  # (an AutoRoundPipe has no forward_backward to overlap)
        reason = overlap_blocker(
            lm.trainer,
            self.async_step,
            self.world_size,
            self._loss_scaler is not None,
            self._rp.has_grad_hooks,
        )
        if reason is not None and self.async_step:  # async_step=False: blocking by definition
            rank_zero_info(f"RoundPipeStrategy(overlap_iterations=True) runs blocking: {reason}")
        self._run.overlap = reason is None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._run.training_step():
            try:
                return super().training_step(*args, **kwargs)
            except BaseException:
                if self._run.steps.step_failed:  # a queued step failed while this step ran
                    self._pipeline_failed()
                raise

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """Backward through the precision plugin: a no-op for a ``forward_backward`` loss
        (already backpropagated), a normal backward for one built from ``self.roundpipe(x)``."""
        if self._rp is not None:
            check_loss_went_through(closure_loss, self._rp)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (training_step) and prepare the master gradients on this thread
        (reduce over processes, unscale, hooks, clipping), then hand ``optimizer.step()``
        to RoundPipe."""
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        opt = raw_optimizer(optimizer)
        rp = self.roundpipe

        overlap = self._run.overlap
        steps = self._run.steps

        def closure_and_reduce() -> Any:
            # (several processes: the closure's backward starts all-reducing finished layers)
            result = self._dp.wrap_closure(opt, closure)()
            if not overlap:
                # blocking calls: the gradients are complete (a step in flight: the reducer
                # waits); reduced, then shown on the module: later hooks see them reduced (DDP)
                self._dp.reduce(opt)
                self._sync_weights()
            # overlapped: the window may still run; the engine defers the step until its
            # gradients are in, and clipping runs there (step_fn)
            return result

        closure_result, do_update = self.precision_plugin.prepare_step(
            opt, model, closure_and_reduce, defer_clipping=overlap
        )
        zero_grad = self._real_zero_grad.get(id(opt), opt.zero_grad)
        # the hyperparameters of this step, before Lightning steps the LR schedulers
        queued = QueuedStep(opt) if self.async_step and do_update else None

        def step_params(params: Sequence[Tensor] | None = None) -> None:
            try:
                if params is None and overlap and do_update:
                    RoundPipePrecision.clip_masters(opt, model)
                if queued is not None:
                    queued.run(params, **kwargs)
                elif do_update:
                    opt.step(**kwargs)
            except BaseException:
                steps.mark_failed()
                raise

        def finish() -> None:
            try:
                zero_grad(set_to_none=True)
                self._dp.after_step(opt)  # sharded: all-gather the weights each process stepped
            except BaseException:
                steps.mark_failed()
                raise
            if do_update:
                steps.applied()

        if do_update:
            mark_lr_scheduler_step_called(opt)
            steps.queued()
        if overlap and queued is not None and steps_in_parts(opt, model):
            # the deepest layers step while the backward still runs on the first ones
            rp.step_layerwise(step_params, finish)
        else:
            rp.step(in_order(step_params, finish), is_async=self.async_step)
        return closure_result

    # -- the weights users read are current ---------------------------------------------------------
    def _sync_weights(self) -> None:
        """Finish the queued step and copy the masters into the module. A failed queued
        step is raised here; it was already counted by Lightning when it was queued, so
        the count is taken back (a checkpoint saved on the exception then records the
        global step its weights belong to)."""
        if self._rp is None or not self._run.is_open:
            return
        try:
            self._rp.synchronize()
        except BaseException:
            self._take_back_lost_steps()  # synchronize() raises once nothing is in flight
            raise

    def _take_back_lost_steps(self) -> None:
        """After a failure, with nothing in flight: the steps Lightning counted when they
        were queued that never reached the weights are lost; a checkpoint written from
        now on takes them back from its step count (``save_checkpoint``)."""
        self._run.steps.take_back()

    def _pipeline_failed(self) -> None:
        """An overlapped iteration failed (raised by the next call or by its lazy loss):
        the steps deferred behind it are dropped. Wait until nothing is in flight, then
        take their counts back, before the error reaches Lightning's exception hooks."""
        if self._rp is not None and self._run.is_open:
            try:
                self._rp.synchronize()
            except BaseException as exc:  # the failure being raised, or its consequence
                log.debug("synchronize() after a pipelined failure raised: %r", exc)
        self._take_back_lost_steps()

    @override
    def on_validation_start(self) -> None:
        self._sync_weights()

    @override
    def on_test_start(self) -> None:
        self._sync_weights()

    @override
    def on_predict_start(self) -> None:
        self._sync_weights()

    @override
    def on_train_end(self) -> None:
        self._sync_weights()

    # -- teardown --------------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._run.fail()
        self._dp.abort()

    def _close_roundpipe(self) -> None:
        """Finish the in-flight step, stop the worker threads, undo what setup installed."""
        rp = self._rp
        if rp is None or not self._run.is_open:
            return
        failed = self._run.close()
        try:
            rp.close()
        except BaseException as exc:
            if not failed:
                raise
            log.debug("RoundPipe.close() after a failure raised: %r", exc)
        finally:
            if isinstance(rp, RoundPipe):
                rp.loss_multiplier = None
                rp.forward_backward_hook = None
            lm = self.lightning_module
            if lm is not None and lm.__dict__.get("roundpipe") is rp:
                object.__delattr__(lm, "roundpipe")
                if self._previous_attr is not _MISSING:
                    object.__setattr__(lm, "roundpipe", self._previous_attr)
            self._previous_attr = _MISSING

    @override
    def teardown(self) -> None:
        self._deferred_model_state = None  # a failed setup never applied it: not the next fit's
        try:
            self._dp.detach()
            self._close_roundpipe()
        finally:
            release_optimizers(self.optimizers, self._real_zero_grad, self._zero_grad_wrappers)
            self._run.end()
            trainer = trainer_of(self.lightning_module)
            callbacks: list[Callback] = getattr(trainer, "callbacks", [])
            if self._flush_callback in callbacks:
                callbacks.remove(self._flush_callback)
            # ParallelStrategy.teardown: cluster environment, optimizers/model to CPU, plugins.
            super().teardown()

    # -- registry -------------------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="RoundPipe pipelined training"
        )


if RoundPipeStrategy.strategy_name not in StrategyRegistry:
    RoundPipeStrategy.register_strategies(StrategyRegistry)
