"""``RoundPipeFabricStrategy``: ``Fabric(strategy="roundpipe")``, a thin adapter of
Fabric's strategy hooks over the training session (:mod:`roundpipe_lightning.session`)
that :class:`RoundPipeStrategy` shares; what the set-up module gains: docs/fabric.md.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from roundpipe_core import AutoRoundPipe, RoundPipe
from roundpipe_core import distributed as D

from ._private import optimizer_view
from .checkpoint_io import CHECKPOINT_KEY
from .session import (
    Session,
    SessionHost,
    SessionSettings,
    all_reduce,
    check_loss_went_through,
)
from .sharded_checkpoint import fabric_shards_dir

__all__ = ["RoundPipeFabricStrategy"]

_OWNER = "RoundPipeFabricStrategy"

#: the attributes ``fabric.setup()``'s module gains
CALLS = ("forward_backward", "synchronize", "roundpipe")


class _SetUpModule(Session):
    """The session of one module given to ``fabric.setup()``: its calls, the losses
    ``forward_backward`` returned, and the user's loop around its gradients."""

    def install(self, precision: Callable[[], Precision]) -> None:
        """Give the module its calls (``precision``: Fabric's plugin, read at each call)."""
        rp, module = self.rp, self.module
        #: optimizers (by id) whose gradients were reduced over the nodes since their step
        self.reduced: set[int] = set()
        #: gradients were produced after the last queued step (which clears its own)
        self.grads_fresh = False
        # the losses forward_backward returned: already backpropagated
        self._losses: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

        @functools.wraps(rp.forward_backward)
        def forward_backward(
            input_args: Any = (), input_kwargs: Any = None, *a: Any, **kw: Any
        ) -> Any:
            if isinstance(rp, AutoRoundPipe):
                raise TypeError(
                    f"{type(module).__name__} is not an nn.Sequential and no preset converts "
                    "it, so it runs split automatically (AutoRoundPipe), which has no "
                    "forward_backward: compute the loss from out = model(x) and call "
                    "fabric.backward(loss), or give fabric.setup() an nn.Sequential"
                )
            self.check_not_reduced()
            plugin = precision()
            input_args, input_kwargs = plugin.convert_input((input_args, input_kwargs))
            with plugin.forward_context():
                out = rp.forward_backward(input_args, input_kwargs, *a, **kw)
            self.grads_fresh = True
            self._remember(out[0] if kw.get("return_outputs") else out)
            return out

        # ``model.state_dict()`` holds the weights of every step queued so far (with
        # async_step=True the module's own tensors lag one step behind)
        self._state_dict_hook = module.register_state_dict_pre_hook(
            lambda *_args, **_kwargs: rp.synchronize()
        )
        # a plain function (a bound method there would count as bypassing the strategy)
        synchronize = functools.wraps(rp.synchronize)(lambda: rp.synchronize())
        for name, value in zip(CALLS, (forward_backward, synchronize, rp)):
            # not nn.Module.__setattr__: the RoundPipe must not become a submodule (its
            # parameters would enter the module's state dict a second time)
            object.__setattr__(module, name, value)

    def _remember(self, loss: Any) -> None:  # a loss, or a tuple / list of them
        if isinstance(loss, Tensor):
            self._losses[id(loss)] = loss
        elif isinstance(loss, (tuple, list)):
            for item in loss:
                self._remember(item)

    def returned(self, tensor: Tensor) -> bool:
        """Whether ``forward_backward`` returned ``tensor`` (its backward already ran)."""
        return self._losses.get(id(tensor)) is tensor

    def holds(self, optimizer: Optimizer) -> bool:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        mine = {id(p) for p in self.rp.model.parameters()}
        mine |= {id(m) for m in self.rp.optim_parameters()}
        return bool(ids & mine)

    def owns(self, optimizer: Any) -> Optimizer | None:
        """The adopted optimizer ``optimizer`` is (or is the view of), or None."""
        for opt in self.optimizers:
            if optimizer is opt or getattr(optimizer, "__dict__", None) is vars(opt):
                return opt
        return None

    def zero_grad(self, optimizer: Optimizer, set_to_none: bool = True) -> None:
        """Clear the master gradients no queued step will clear."""
        if not self.grads_fresh:
            return
        self.rp.synchronize()  # nothing in flight: a pending iteration's gradients are in
        self.real_zero_grad[id(optimizer)](set_to_none=set_to_none)
        self.grads_fresh = False
        self.reduced.clear()

    def reduce(self, optimizer: Optimizer) -> None:
        """Reduce the master gradients over the nodes, once per step (collective)."""
        if self.dp.world_size == 1 or id(optimizer) in self.reduced:
            return
        self.rp.synchronize()  # pending iterations' gradients are in; the last step is done
        self.dp.reduce(optimizer)
        self.reduced.add(id(optimizer))

    def check_not_reduced(self) -> None:
        """Refuse new gradients once this step's were reduced (they would miss it)."""
        if self.reduced:
            raise RuntimeError(
                "RoundPipeFabricStrategy: this step's gradients were already reduced over the "
                "nodes (by fabric.clip_gradients); run every backward of the step first, then "
                "clip, then opt.step()"
            )

    def close(self, failed: bool = False) -> None:
        """:meth:`Session.close`, and the installed calls taken off the module."""
        self._state_dict_hook.remove()
        try:
            super().close(failed)
        finally:
            for name in CALLS:
                if name in vars(self.module):
                    object.__delattr__(self.module, name)


def _from_environment(name: str | None, alone: int) -> Any:
    """A property read from the cluster environment's method ``name`` (``alone``
    without one, or for ``name=None``); its setter ignores what it is given."""

    def read(self: Any) -> int:
        env = self.cluster_environment
        return getattr(env, name)() if env is not None and name is not None else alone

    return property(read, lambda self, _ignored: None)


class RoundPipeFabricStrategy(SessionHost, SingleDeviceStrategy):
    """Run the modules given to ``fabric.setup()`` with RoundPipe.

    One process drives the whole pool (Fabric's ``devices``), so it is a single-device
    strategy to Fabric; several nodes (one process each) are data parallel as under
    ``RoundPipeStrategy`` (docs/fabric.md, "Several nodes").

    ``loss_reduction``, ``num_microbatch``, ``execute_plan``, ``optim_dtype``, ``pin_model``,
    ``async_step``, ``fuse_optimizer``, ``recompute_grain``, ``preserve_rng_state``,
    ``model_run_config``, ``grad_reduce_op``, ``process_group_timeout``, ``shard_host_state``
    and ``offload_dir`` are as for :class:`~roundpipe_lightning.RoundPipeStrategy`
    (``"mean"``: a ``loss_fn`` returning a batch mean gives plain Fabric's loss and
    gradients; sharded, ``fabric.save`` writes a shard per node).

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: as for
            any Fabric strategy (normally left to ``Fabric(...)``). Precision: ``"32-true"``
            or ``"bf16-mixed"``.

    The RoundPipe arguments are keywords only. ``overlap_iterations`` has no Fabric
    counterpart (the loop is the user's: pass ``blocking=False`` to ``forward_backward``),
    and the gradient reduction runs right before the step, not overlapped with the
    backward (which backward ends an accumulation window is not known). A wrong argument
    is a TypeError / ValueError naming it and what it accepts.
    """

    strategy_name = "roundpipe"
    _entry = "Fabric"

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision
        )
        fixed = {"overlap_iterations": False, "overlap_grad_reduce": False}
        self.settings = SessionSettings.of(_OWNER, settings, fixed)
        # Fabric's connector fills these in (it looks for the attributes)
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        self._checked = False
        self._runs: list[_SetUpModule] = []

    # -- where it runs: one process per node drives the node's pool ----------------------------

    # SingleDeviceStrategy.__init__ assigns the one-process values (0, 0, 1); the cluster
    # environment decides, so the setters ignore them (Fabric reads them with getattr)
    world_size = _from_environment("world_size", 1)
    global_rank = _from_environment("global_rank", 0)
    node_rank = _from_environment("node_rank", 0)
    local_rank = _from_environment(None, 0)  # one process per node

    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """``fabric.setup_dataloaders`` gives each node a ``DistributedSampler`` shard
        (None in one process: the loader stays as it is)."""
        if self.world_size == 1:
            return None
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _check_run(self) -> None:
        """Refuse what this strategy cannot run, once, before the first module is built."""
        if self._checked:
            return
        env = self.cluster_environment
        launched = os.environ.get("WORLD_SIZE", "1")
        processes = max(
            env.world_size() if env is not None else 1, int(launched) if launched.isdigit() else 1
        )
        self.check_launch(processes)
        if self.world_size > 1:  # here: Fabric calls setup_environment only from fabric.launch()
            timeout = self.settings.process_group_timeout
            D.init_process_group(env, backend="gloo", timeout=timeout)
        self._checked = True

    @override
    def setup_environment(self) -> None:
        self._check_run()
        assert self.accelerator is not None
        self.accelerator.setup_device(self.compute_devices[0])

    @override
    def module_to_device(self, module: nn.Module) -> None:
        return None  # parameters stay in host memory; RoundPipe uploads stages

    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor | Any:
        return tensor if self.world_size == 1 else all_reduce(tensor, group, reduce_op)

    @override
    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        if self.world_size == 1:
            return tensor
        if sync_grads:
            raise NotImplementedError(
                f"{_OWNER}: all_gather(sync_grads=True) is not supported (the model state is "
                "on the host, outside autograd across processes)"
            )
        return D.all_gather(tensor, group)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.world_size > 1:
            D.barrier(timeout=self.settings.process_group_timeout)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return obj if self.world_size == 1 else D.broadcast_object(obj, src)

    # -- plugins (the checkpoint_io: SessionHost's) ----------------------------------------------
    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        # checked when Fabric(...) hands it over, before anything (the module) is converted
        mixed_bf16 = isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed"
        if plugin is not None and type(plugin) is not Precision and not mixed_bf16:
            name = getattr(plugin, "precision", type(plugin).__name__)
            raise ValueError(
                f"{_OWNER} runs Fabric(precision='32-true') or 'bf16-mixed', got {name!r}. For "
                "half-precision weights, cast the module yourself (net.to(torch.bfloat16)) and "
                "keep '32-true': the optimizer then updates fp32 master copies (optim_dtype)."
            )
        self._precision = plugin

    # -- set-up ----------------------------------------------------------------------------------
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Wrap ``module`` in a RoundPipe (what ``model(x)`` runs) and give it its calls."""
        self._check_run()
        if not isinstance(module, nn.Module):
            raise TypeError(f"fabric.setup() takes an nn.Module, got {type(module).__name__}")
        if isinstance(module, RoundPipe):
            raise TypeError(
                "fabric.setup() got a RoundPipe; give it the plain nn.Sequential (or Hugging "
                f"Face model) instead -- {_OWNER} wraps it and returns the pipelined module"
            )
        clash = [name for name in CALLS if hasattr(module, name)]
        if clash:  # refused before a RoundPipe claims its parameters
            raise ValueError(
                f"{type(module).__name__} already has {', '.join(map(repr, clash))}: "
                f"{_OWNER} gives the module passed to fabric.setup() the attributes "
                f"{', '.join(CALLS)}. Rename yours, and set each module up once."
            )
        hint = "compute the loss from out = model(x) and call fabric.backward(loss)"
        name, devices = type(module).__name__, self.compute_devices
        rp = self.settings.build_roundpipe(module, name, devices, "fabric.setup() got", hint)
        try:
            dp = self.settings.data_parallel()
            run = _SetUpModule(self.settings, rp, module, dp, self.async_step)
            run.install(lambda: self.precision)
            rank_zero_info(run.summary())
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
        policy = functools.partial(run.zero_grad, optimizer)
        run.adopt(optimizer, policy, "the module's parameters()")
        # several nodes: one gradient reducer per optimizer (and, sharded, its ownership)
        run.dp.attach(run.rp, run.optimizers, async_step=self.async_step)
        return optimizer_view(optimizer, policy)  # what Fabric wraps

    def _run_of(self, module: Any) -> _SetUpModule | None:
        """The run of a set-up module or of its RoundPipe, or None."""
        return next((run for run in self._runs if module in (run.rp, run.module)), None)

    def _adopted(self, optimizer: Any) -> tuple[_SetUpModule, Optimizer] | None:
        """The run of ``optimizer`` and the user's optimizer behind it, or None."""
        for run in self._runs:
            raw = run.owns(optimizer)
            if raw is not None:
                return run, raw
        return None

    # -- training --------------------------------------------------------------------------------
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Nothing for a loss ``forward_backward`` returned (already backpropagated)."""
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
            run.check_not_reduced()
        super().backward(tensor, module, *args, **kwargs)
        for run in self._runs:
            run.grads_fresh = True

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Queue ``optimizer.step()`` (which clears the gradients) on RoundPipe."""
        adopted = self._adopted(optimizer)
        if adopted is None:
            raise ValueError(
                f"{type(optimizer).__name__} was not set up with a module of {_OWNER}; pass it "
                "to fabric.setup(module, optimizer)"
            )
        if kwargs.pop("closure", None) is not None:
            raise TypeError(
                f"{_OWNER} runs optimizer.step() on the master weights later (on the optimizer "
                "thread), where a closure cannot re-evaluate the loss; call opt.step() without one"
            )
        run, raw = adopted
        # several nodes: reduced on the optimizer thread before the step, once the calls in
        # flight are in (blocking=False calls still overlap), unless clipping reduced them
        reduce_first = id(raw) not in run.reduced
        # the step clears the gradients there are now
        run.grads_fresh = False
        run.reduced.clear()
        run.queue_step(raw, kwargs, reduce_first=reduce_first)

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
        shard = self._reduce_for_clipping(optimizer)
        if shard is None:
            return super().clip_gradients_norm(
                module,
                optimizer,
                max_norm,
                norm_type=norm_type,
                error_if_nonfinite=error_if_nonfinite,
            )
        # the norm over every node's share (collective)
        norm = shard.clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients is non-finite, so "
                "it cannot be clipped (the gradients were scaled by it on every node)"
            )
        return norm

    @override
    def clip_gradients_value(
        self, module: nn.Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        self._reduce_for_clipping(optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    def _reduce_for_clipping(self, optimizer: Any) -> D.HostShard | None:
        """Once the pending iterations' gradients are in, reduce ``optimizer``'s now
        (clipping reads reduced gradients, as under DDP); returns its shard, or None."""
        self._synchronize()
        adopted = self._adopted(optimizer)
        if adopted is None:
            return None
        adopted[0].reduce(adopted[1])
        return adopted[0].dp.shard(adopted[1])

    # -- checkpoints -----------------------------------------------------------------------------
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        run = self._run_of(module)
        # a set-up module's state_dict() synchronizes first (the hook install() adds)
        return super().get_module_state_dict(module if run is None else run.module)

    @override
    def load_module_state_dict(
        self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True
    ) -> None:
        run = self._run_of(module)
        if run is None:
            super().load_module_state_dict(module, state_dict, strict=strict)
            return
        run.rp.synchronize()
        run.module.load_state_dict(state_dict, strict=strict)
        run.load_masters({})  # each master equal to its weight just loaded
        run.grads_fresh = False

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        full = functools.partial(super().get_optimizer_state, optimizer)
        adopted = self._adopted(optimizer)
        if adopted is None:
            return full()
        adopted[0].rp.synchronize()  # the step in flight writes the state
        return adopted[0].optimizer_state(adopted[1], full)

    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Fabric's save, plus ``checkpoint["roundpipe"][key]`` for each set-up module
        under ``key``; sharded, every node writes its share of the optimizer under
        ``key`` into ``<path>.shards/key/``."""
        self._synchronize()
        checkpoint = self._convert_stateful_objects_in_state(state, filter=filter or {})
        sections = {}
        for key, obj in state.items():
            adopted, run = self._adopted(obj), self._run_of(obj)
            if adopted is not None:
                # (the key is checked, sharded or not)
                adopted[0].save_shard(adopted[1], fabric_shards_dir(path, key))
            elif run is not None:
                sections[key] = run.section(run.optimizers)
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
        """Fabric's load; a set-up module's masters follow its weights or its section,
        an optimizer saved sharded is read from its shards (any node count)."""
        self._synchronize()
        # the set-up optimizers after the modules: their state may be a marker of shards
        ours = {}
        plain: Any = state
        if isinstance(state, Mapping):
            ours = {key: a for key, obj in state.items() if (a := self._adopted(obj)) is not None}
            if ours:
                plain = {k: v for k, v in state.items() if k not in ours} or None
        remainder = super().load_checkpoint(
            path, state=plain, strict=strict, weights_only=weights_only
        )
        if ours and isinstance(state, dict):
            state.update(plain or {})  # plain entries were restored into the copy
        # the masters first: with offload_dir a generation of masters holds the optimizer
        # state too, which the optimizers' own load replaces next
        if isinstance(state, Mapping) and state and CHECKPOINT_KEY not in state:
            sections = remainder.pop(CHECKPOINT_KEY, None) or {}
            for key, obj in state.items():
                of_module = self._run_of(obj)
                if of_module is not None:
                    of_module.load_section(sections.get(key), strict)
        for key, (run, raw) in ours.items():
            if key not in remainder:
                if strict:
                    raise KeyError(f"fabric.load(): the checkpoint {path} has no {key!r}")
                continue
            run.load_optimizer(raw, remainder.pop(key), fabric_shards_dir(path, key))
        return remainder

    # -- end -------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Stop every RoundPipe and undo what setup installed (the modules then hold
        the trained weights)."""
        try:
            while self._runs:
                run = self._runs.pop()
                run.dp.detach()  # its groups; the default process group stays
                run.close()
        finally:
            super().teardown()


if RoundPipeFabricStrategy.strategy_name not in STRATEGY_REGISTRY:
    STRATEGY_REGISTRY.register(
        RoundPipeFabricStrategy.strategy_name,
        RoundPipeFabricStrategy,
        "RoundPipe pipelined training (Fabric)",
    )
