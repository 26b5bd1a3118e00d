"""``RoundPipeStrategy``: train a LightningModule's ``nn.Sequential`` with RoundPipe.

A thin adapter of Lightning's ``ParallelStrategy`` hooks over the training session
(:mod:`roundpipe_lightning.session`), which the Fabric strategy shares; docs/lightning.md
("What maps to what") says what each hook becomes.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from roundpipe_core import AutoRoundPipe, ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core import distributed as D

from ._overlap import OverlappedForwardBackward, overlap_blocker, steps_in_parts
from ._private import defer_zero_grad, restore_zero_grad, uncount_saved_steps
from .checkpoint_io import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_KEY,
    check_lightning_checkpoint,
)
from .precision import LossScaler, RoundPipePrecision
from .session import (
    SETTINGS,
    Session,
    SessionHost,
    SessionSettings,
    all_reduce,
    check_loss_went_through,
    check_type,
)
from .sharded_checkpoint import remove_shards, shards_dir

__all__ = ["RoundPipeStrategy", "CHECKPOINT_KEY", "CHECKPOINT_FORMAT"]

log = logging.getLogger(__name__)

_OWNER = "RoundPipeStrategy"
_MISSING = object()
_LOSS_HINT = (
    "compute the loss from self.roundpipe(...) (e.g. self.roundpipe(input_ids=x, labels=x)"
    ".loss), Lightning backpropagates it"
)


# -- the run's phases ----------------------------------------------------------------------------
class Phase(str, Enum):
    """Where a run stands (``on_exception`` to FAILED; teardown back to NO_RUN)::

    NO_RUN --setup--> OPEN <--training_step--> IN_TRAINING_STEP
                        |  \\--on_exception--> FAILED
                        v                        |
                      CLOSED <-----close---------/
    """

    NO_RUN = "no_run"  # no RoundPipe: before setup, after teardown
    OPEN = "open"  # the RoundPipe runs calls, outside training_step
    IN_TRAINING_STEP = "in_training_step"  # inside the LightningModule's training_step
    FAILED = "failed"  # Lightning reported an exception: closing tolerates errors
    CLOSED = "closed"  # the RoundPipe was closed (its worker threads stopped)


class RunState:
    """A :class:`Phase`, and ``overlap`` (whether this fit overlaps its iterations,
    decided once at train start)."""

    def __init__(self) -> None:
        self.phase = Phase.NO_RUN
        self.overlap = False

    @property
    def is_open(self) -> bool:
        return self.phase in (Phase.OPEN, Phase.IN_TRAINING_STEP, Phase.FAILED)

    @property
    def in_training_step(self) -> bool:
        return self.phase is Phase.IN_TRAINING_STEP

    def open(self) -> None:
        self.phase = Phase.OPEN

    @contextmanager
    def training_step(self) -> Iterator[None]:
        before = self.phase
        if before is Phase.OPEN:
            self.phase = Phase.IN_TRAINING_STEP
        try:
            yield
        finally:
            if self.phase is Phase.IN_TRAINING_STEP:
                self.phase = before

    def fail(self) -> None:
        if self.is_open:
            self.phase = Phase.FAILED

    def close(self) -> bool:
        """Returns whether the run had failed."""
        failed = self.phase is Phase.FAILED
        self.phase = Phase.CLOSED
        self.overlap = False
        return failed

    def end(self) -> None:
        self.phase = Phase.NO_RUN
        self.overlap = False


class FlushWeights(Callback):
    """Calls ``flush`` (finish the queued step) before each hook where users read weights
    (:data:`FLUSH_HOOKS`). First in ``trainer.callbacks`` with ``async_step=True``:
    callback hooks run before the LightningModule's and the strategy's own, so all of
    them see the weights of every step taken so far."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush


#: the callback hooks before which :class:`FlushWeights` flushes
FLUSH_HOOKS = (
    "on_train_epoch_end",
    "on_train_end",
    "on_validation_start",
    "on_test_start",
    "on_predict_start",
    "on_save_checkpoint",
)
for _hook in FLUSH_HOOKS:
    setattr(FlushWeights, _hook, lambda self, *args, **kwargs: self._flush())


# -- Trainer-only checks ---------------------------------------------------------------------------
def check_shardable(shard_host_state: bool, loss_scaler: object | None) -> None:
    """Refuse ``shard_host_state=True`` with a loss scaler (``16-mixed``)."""
    if shard_host_state and loss_scaler is not None:
        raise ValueError(
            "RoundPipeStrategy(shard_host_state=True) does not support precision='16-mixed': each "
            "process sees only its share of the gradients, so the loss scaler's overflow check "
            "would differ between processes. Use precision='bf16-mixed' or 'bf16-true' (no loss "
            "scaling), or shard_host_state=False."
        )


def sequential_of(lm: pl.LightningModule) -> nn.Module:
    """Call ``configure_sequential()`` and check what it returned (a submodule)."""
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
    return net


def trainer_of(lm: pl.LightningModule | None) -> pl.Trainer | None:
    try:
        return None if lm is None else lm.trainer
    except RuntimeError:  # "not attached to a Trainer"
        return None


def raw_optimizer(opt: Any) -> Optimizer:
    return opt.optimizer if isinstance(opt, LightningOptimizer) else opt


class RoundPipeStrategy(SessionHost, ParallelStrategy):
    """Run a LightningModule's ``configure_sequential()`` network with RoundPipe.

    Args:
        loss_reduction: how ``forward_backward`` combines its microbatch losses.
            ``"mean"`` (default): each weighted by its share of the batch, so a ``loss_fn``
            returning a batch mean gives plain Lightning's loss and gradients, whatever the
            microbatch count. ``"sum"``: RoundPipe's published contract, their sum.
        num_microbatch: microbatches per pipelined call (default: the engine's,
            :func:`~roundpipe_core.planning.plan.default_num_microbatch`: devices + 1 on
            GPUs; on CPU workers 1, or one per worker where the one-stage plan runs on
            every worker at once -- the default for a model without buffers).
        execute_plan: the stage plan of ``forward_backward``: ``None`` (the engine's
            default), ``"auto"``, a ``ModelExecutePlan``, a layout string such as
            ``"fwd=3,2 bwd=1,2,2,1"`` or a dict of ``from_layout`` arguments
            (:mod:`roundpipe_lightning.plans`).
        optim_dtype: dtype of the optimizer's master weights (default fp32; a name
            such as ``"float32"`` works too, for YAML configs). ``None``: the model's dtype.
        pin_model: host memory of the parameters on CUDA ("alloc", "register", "off").
        async_step: overlap the optimizer step with the next iteration (weights one
            step stale). ``False``: plain PyTorch's computation, and parameters already
            in ``optim_dtype`` are their own masters (one copy of the weights in host
            memory). ``None`` (default): ``True`` on GPUs; ``False`` on CPU workers, whose
            cores the optimizer thread would compete for.
        fuse_optimizer: switch optimizers built without a ``fused`` / ``foreach`` choice
            (Adam, AdamW, SGD, Adagrad) in place to torch's fused CPU kernel: the same
            update within fp32 rounding, several times faster. ``False``: as built.
        overlap_iterations: with ``async_step=True``, ``training_step``'s
            ``forward_backward`` runs non-blocking and returns a lazy loss (same numbers;
            docs/lightning.md, "Overlapped iterations"); ``blocking=True`` is respected.
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
        offload_dir: a directory for the disk tier: the fp32 masters and the optimizer
            state live in files there, streamed layer by layer by each step -- the same
            weights, bit for bit, as in RAM. Needs an nn.Sequential, one elementwise
            optimizer (Adam, AdamW, SGD, ...) and one process; checkpoints as without it
            (docs/lightning.md, "Masters and optimizer state on disk").
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for any Lightning ``ParallelStrategy`` (normally left to the Trainer). The
            precision plugin becomes a :class:`~roundpipe_lightning.precision.RoundPipePrecision`.

    The arguments are kept, checked, in ``settings`` and read as attributes
    (``strategy.num_microbatch``); a wrong one is a TypeError / ValueError naming it.
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
        offload_dir: str | os.PathLike[str] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self._default_precision = RoundPipePrecision()
        # wrong plugins fail now, not at the first save, at teardown, or silently ignored
        check_type("checkpoint_io", checkpoint_io, (CheckpointIO,), "a lightning CheckpointIO")
        if isinstance(precision_plugin, (str, int)):
            raise TypeError(
                f"RoundPipeStrategy(precision_plugin={precision_plugin!r}): pass the precision to "
                f"the Trainer instead: Trainer(precision={precision_plugin!r}, strategy=...)"
            )
        accepted = "a lightning Precision plugin"
        check_type("precision_plugin", precision_plugin, (Precision,), accepted)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        arguments = {k: v for k, v in locals().items() if k in SETTINGS}
        self.settings = SessionSettings.of(_OWNER, arguments)
        self._session: Session | None = None
        self._run = RunState()
        self._zero_grad_wrappers: list[Any] = []  # LightningOptimizers (manual optimization)
        self._previous_attr: Any = _MISSING
        self._flush_callback = FlushWeights(self._sync_weights)
        #: a checkpoint's model state read before setup, applied once setup built the masters
        self._deferred_model_state: tuple[Mapping[str, Any], bool] | None = None
        # one process per node, data parallel over torch.distributed (no-ops in one process)
        self._dp = self.settings.data_parallel()

    @property
    def roundpipe(self) -> RoundPipe | AutoRoundPipe:
        """The RoundPipe of the current run (after setup)."""
        if self._session is None:
            raise RuntimeError(
                "RoundPipeStrategy has no RoundPipe yet; it is built when the Trainer runs"
            )
        return self._session.rp

    # -- where it runs: one process per node drives the node's pool --------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        # model state, batches and losses live on the host; the pool is RoundPipe's business
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # one process per node: the node's whole pool consumes one shard
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def model_to_device(self) -> None:
        return None  # parameters stay in host memory; RoundPipe uploads stages

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        return all_reduce(tensor, group, reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        D.barrier(timeout=self._dp.timeout)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return D.broadcast_object(obj, src)

    # -- precision ---------------------------------------------------------------------------
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
        return self.precision_plugin.scaler

    # -- setup ---------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        # fail on an unsupported configuration before anything starts
        _ = self.precision_plugin
        env = self.check_launch()
        if self.world_size > 1:
            check_shardable(self._dp.shard_host_state, self._loss_scaler)
            self._dp.connect(env, self.world_size)
        assert self.accelerator is not None
        self.accelerator.setup_device(self.compute_devices[0])

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        # half-precision plugins cast the module here, before RoundPipe copies fp32 masters
        self.model = self.precision_plugin.convert_module(self.model)
        self._build_roundpipe()
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if self.async_step and self._flush_callback not in callbacks:
            callbacks.insert(0, self._flush_callback)  # first (FlushWeights says why)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            assert self._session is not None
            self._session.check_host_budget()  # a few lines beside Lightning's set-up facts
            # every process starts from rank 0's weights; one gradient reducer per optimizer
            self._dp.attach(self.roundpipe, self.optimizers, async_step=self.async_step)
            sharded = self._dp.state_shards > 1  # clipping: the norm over every process's share
            self.precision_plugin.clip_norm_fn = self._dp.clip_grad_norm_ if sharded else None
        self.setup_precision_plugin()
        # a checkpoint read before setup (fit(ckpt_path=...)): its model state, now
        deferred, self._deferred_model_state = self._deferred_model_state, None
        if deferred is not None:
            self.load_model_state_dict(*deferred)

    def _build_roundpipe(self) -> None:
        lm = self.lightning_module
        assert lm is not None
        self._close_roundpipe()
        source = "configure_sequential() returned"
        rp = self.settings.build_roundpipe(
            sequential_of(lm), type(lm).__name__, self.compute_devices, source, _LOSS_HINT
        )
        self._session = Session(self.settings, rp, lm, self._dp, self.async_step)
        self._run.open()
        if isinstance(rp, RoundPipe):  # (an AutoRoundPipe has no fused call to hook)
            rp.loss_multiplier = self._loss_multiplier
            if self.settings.overlap_iterations:
                rp.forward_backward_hook = OverlappedForwardBackward(
                    lambda: self._run.in_training_step and self._run.overlap,
                    self._pipeline_failed,
                )
        # Not a registered submodule (the module's state_dict keeps its own names); a value it
        # had under that name (``self.roundpipe = None``) comes back at teardown.
        self._previous_attr = lm.__dict__.get("roundpipe", _MISSING)
        object.__setattr__(lm, "roundpipe", rp)

    def _loss_multiplier(self) -> float:
        """``1/accumulate_grad_batches`` (as Lightning divides the loss) times the loss scale."""
        if not self._run.in_training_step:
            return 1.0
        factor = 1.0
        lm = self.lightning_module
        trainer = trainer_of(lm)
        if lm is not None and lm.automatic_optimization and trainer is not None:
            factor /= trainer.accumulate_grad_batches
        return factor * self.precision_plugin.loss_scale()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self._session is not None
        for opt in self.optimizers:
            self._session.adopt(raw_optimizer(opt))

    # -- training ------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._run.overlap = False
        lm, session = self.lightning_module, self._session
        if lm is None or session is None:
            return
        if not lm.automatic_optimization:
            # at train start: Lightning re-creates its LightningOptimizers after setup. The
            # user's opt.zero_grad() runs in order with the queued step, right after it
            wrappers = lm.optimizers(use_pl_optimizer=True)
            for wrapper in wrappers if isinstance(wrappers, list) else [wrappers]:
                raw = raw_optimizer(wrapper)
                real = session.real_zero_grad.get(id(raw))
                if real is None:
                    continue
                ordered = functools.partial(self._zero_grad_in_order, real)
                defer_zero_grad(raw, ordered)
                if wrapper is not raw:
                    defer_zero_grad(wrapper, ordered)
                    self._zero_grad_wrappers.append(wrapper)
        session.check_optimizer_states()  # also state a hook loaded, before the first step
        rp = session.rp
        if not self.settings.overlap_iterations or not isinstance(rp, RoundPipe):
            return  # (an AutoRoundPipe has no forward_backward to overlap)
        reason = overlap_blocker(lm.trainer, self.async_step, self._loss_scaler is not None)
        if reason is None and session.tier is not None:
            opts = [raw_optimizer(o) for o in self.optimizers]
            if not all(steps_in_parts(o, lm) for o in opts):
                reason = (
                    "offload_dir steps layer by layer as the gradients complete, and gradient "
                    "clipping needs every gradient first"
                )
        if reason is not None and self.async_step:  # async_step=False: blocking by definition
            rank_zero_info(f"{_OWNER}(overlap_iterations=True) runs blocking: {reason}")
        self._run.overlap = reason is None

    def _zero_grad_in_order(self, real: Callable[..., None], set_to_none: bool = True) -> None:
        """A manual ``zero_grad``: after the queued step has read the gradients, never under it."""
        self.roundpipe.after_step(functools.partial(real, set_to_none=set_to_none))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._run.training_step():
            try:
                return super().training_step(*args, **kwargs)
            except BaseException:
                if self._session is not None and self._session.steps.step_failed:
                    self._pipeline_failed()  # a queued step failed while this step ran
                raise

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """A no-op for a ``forward_backward`` loss (already backpropagated)."""
        if self._session is not None:
            check_loss_went_through(closure_loss, self._session.rp)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure and prepare the master gradients on this thread (reduce,
        unscale, hooks, clipping), then hand ``optimizer.step()`` to RoundPipe."""
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule) and self._session is not None
        opt = raw_optimizer(optimizer)
        overlap = self._run.overlap

        def closure_and_reduce() -> Any:
            if overlap:
                # the window may still run: its gradients are reduced on the optimizer
                # thread once they are in, before the clipping and the step
                return closure()
            # blocking calls: the backward starts all-reducing finished layers; once all are
            # reduced they are shown on the module, so later hooks see them reduced (DDP)
            result = self._dp.wrap_closure(opt, closure)()
            self._dp.reduce(opt)
            self._sync_weights()
            return result

        closure_result, do_update = self.precision_plugin.prepare_step(
            opt, model, closure_and_reduce, defer_clipping=overlap
        )
        clip = functools.partial(RoundPipePrecision.clip_masters, opt, model)
        self._session.queue_step(
            opt,
            kwargs,
            update=do_update,
            clip=clip if overlap and do_update else None,
            reduce_first=overlap,
            layerwise=overlap and steps_in_parts(opt, model),
        )
        return closure_result

    # -- the weights users read are current ------------------------------------------------------
    def _sync_weights(self) -> None:
        """Finish the queued step. A failed one is raised here, its count (Lightning's,
        at queueing) taken back, so a checkpoint saved on the exception records the
        global step its weights belong to."""
        if self._session is None or not self._run.is_open:
            return
        try:
            self._session.rp.synchronize()
        except BaseException:
            self._session.steps.take_back()  # synchronize() raises once nothing is in flight
            raise

    def _pipeline_failed(self) -> None:
        """An overlapped iteration failed: once nothing is in flight, take back the
        counts of the steps dropped behind it, before Lightning's exception hooks run."""
        if self._session is None:
            return
        if self._run.is_open:
            try:
                self._session.rp.synchronize()
            except BaseException as exc:  # the failure being raised, or its consequence
                log.debug("synchronize() after a pipelined failure raised: %r", exc)
        self._session.steps.take_back()

    # -- checkpoints (the checkpoint_io: SessionHost's) ----------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._sync_weights()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        self._sync_weights()
        full = functools.partial(super().optimizer_state, optimizer)
        if self._session is None:
            return full()
        return self._session.optimizer_state(raw_optimizer(optimizer), full)

    def roundpipe_state_dict(self) -> dict[str, Any]:
        """``checkpoint["roundpipe"]`` (:meth:`~roundpipe_lightning.session.Session.section`),
        after the step in flight finished: nothing updates the live masters until the
        save returns."""
        self._sync_weights()
        assert self._session is not None
        # (this fit's optimizers: a save after teardown finds them here, not in the session)
        return self._session.section(self.optimizers, self._loss_scaler)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        session, lm = self._session, self.lightning_module
        if session is not None:
            checkpoint[CHECKPOINT_KEY] = self.roundpipe_state_dict()
            for i, opt in enumerate(self.optimizers):
                session.save_shard(raw_optimizer(opt), shards_dir(filepath, i))
        if lm is not None and session is not None:
            # steps Lightning counted when queued whose update failed: the weights saved
            # here never received them (read after the weights were flushed above)
            uncount_saved_steps(checkpoint, session.steps.lost, lm.automatic_optimization)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """``False``: the file is read before setup with the user's ``weights_only``
        (Lightning's after-setup path drops it); the model state waits in
        :meth:`load_model_state_dict` until setup built the masters."""
        return False

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        """The file and its ``.shards/`` directory (rank 0, which wrote the file: the
        shards are on a file system every node sees)."""
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            remove_shards(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._session is None:  # read before setup: the masters do not exist yet
            self._deferred_model_state = (checkpoint, strict)
            return
        self._sync_weights()
        load_weights = functools.partial(super().load_model_state_dict, checkpoint, strict=strict)
        section = checkpoint.get(CHECKPOINT_KEY)
        self._session.load_section(section, strict, load_weights, self._loss_scaler)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # a sharded optimizer state lives beside the file: remember where that is
        self._loaded_checkpoint_path = checkpoint_path
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        check_lightning_checkpoint(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._sync_weights()
        assert self._session is not None
        path = getattr(self, "_loaded_checkpoint_path", None)
        for i, (opt, state) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            directory = None if path is None else shards_dir(path, i)
            self._session.load_optimizer(raw_optimizer(opt), state, directory)

    # -- teardown --------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._run.fail()
        self._dp.abort()

    def _close_roundpipe(self) -> None:
        """Stop the RoundPipe and undo what setup installed."""
        session = self._session
        if session is None or not self._run.is_open:
            return
        rp = session.rp
        try:
            session.close(failed=self._run.close())
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
            if self._session is not None:
                self._session.release()
                self._session.steps.reset()
            for wrapper in self._zero_grad_wrappers:
                restore_zero_grad(wrapper)
            self._zero_grad_wrappers.clear()
            self._run.end()
            trainer = trainer_of(self.lightning_module)
            callbacks: list[Callback] = getattr(trainer, "callbacks", [])
            if self._flush_callback in callbacks:
                callbacks.remove(self._flush_callback)
            super().teardown()


if RoundPipeStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        RoundPipeStrategy.strategy_name, RoundPipeStrategy, "RoundPipe pipelined training"
    )
