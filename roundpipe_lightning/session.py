"""A RoundPipe training session: what the Trainer strategy (:mod:`.strategy`) and the
Fabric strategy (:mod:`.fabric`) both do -- the arguments (:class:`SessionSettings`), one
process per node, and :class:`Session` (the optimizers, the queued step, the checkpoint
section) -- as Lightning's ``pytorch/strategies/fsdp.py`` builds on ``fabric/strategies/fsdp.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.rank_zero import (
    rank_zero_debug,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)
from torch import Tensor, nn
from torch.optim import Optimizer

from roundpipe_core import AutoRoundPipe, ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core import distributed as D
from roundpipe_core.autosplit import auto_wrap
from roundpipe_core.distributed.reducer import REDUCE_OPS
from roundpipe_core.kinds import PinMode, RecomputeGrain, check_flag
from roundpipe_core.loss import LOSS_REDUCTIONS
from roundpipe_core.optim import check_state_matches, use_fastest_, why_not_faster
from roundpipe_core.running.host_memory import (
    UnknownOptimizerError,
    available_host_memory,
    check_host_memory,
    estimate_host_memory,
)
from roundpipe_core.stepping.disk_tier import DiskTier, check_offload_args
from roundpipe_core.stepping.layerwise import step_subset

from ._private import (
    WrappingCheckpointIO,
    defer_zero_grad,
    is_lr_scheduler_step_wrapper,
    mark_lr_scheduler_step_called,
    restore_zero_grad,
)
from .checkpoint_io import (
    CHECKPOINT_FORMAT,
    StreamingCheckpointIO,
    check_roundpipe_section,
    restore_learned,
)
from .plans import resolve_execute_plan
from .sharded_checkpoint import (
    is_marker,
    load_optimizer_state,
    marker,
    of_optimizer,
    sharded_masters,
)

log = logging.getLogger(__name__)

RP = RoundPipe | AutoRoundPipe

# -- arguments ---------------------------------------------------------------------------------
#: short names torch has no attribute for (the others: ``getattr(torch, name)``)
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.float32`` or a name ("float32", "torch.bfloat16", "bf16") -> dtype (YAML/CLI friendly)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        dtype = getattr(torch, _DTYPE_ALIASES.get(key, key), None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2:
            return dtype
        raise ValueError(
            f"optim_dtype={value!r} is not a floating dtype name; use e.g. 'float32', 'bfloat16' or 'float16'"
        )
    raise TypeError(
        f"optim_dtype must be a torch.dtype, a dtype name or None, got {type(value).__name__}"
    )


def check_bool(name: str, value: Any, owner: str, none: str = "") -> None:
    """Refuse a ``value`` that is not a bool (no ``bool()`` coercion: ``"False"`` would
    be True), nor None where ``none`` says what None means."""
    try:
        check_flag(value, name, none)
    except TypeError as exc:
        raise TypeError(
            f"{owner}({name}={value!r}): {exc}; in YAML write true / false without quotes"
        ) from None


def _values(kind: type[Enum]) -> tuple[str, ...]:
    return tuple(member.value for member in kind)


def check_choice(name: str, value: Any, choices: tuple[Any, ...], owner: str) -> None:
    kinds = {type(c) for c in choices if c is not None}
    if value is not None and not isinstance(value, tuple(kinds)):
        raise TypeError(
            f"{owner}({name}={value!r}): {name} must be one of {choices}, got "
            f"{type(value).__name__}"
        )
    if value not in choices:
        raise ValueError(f"{owner}({name}={value!r}): {name} must be one of {choices}")


def check_num_microbatch(value: Any, owner: str = "RoundPipeStrategy") -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f"{owner}(num_microbatch={value!r}): num_microbatch must be a positive int "
            f"or None, got {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"{owner}(num_microbatch={value!r}): num_microbatch must be >= 1 (or None "
            "for the engine's default: devices + 1 on GPUs, 1 or one per worker on CPU "
            "workers)"
        )


def check_type(
    name: str, value: Any, types: tuple[type, ...], accepted: str, owner: str = "RoundPipeStrategy"
) -> None:
    if value is not None and not isinstance(value, types):
        raise TypeError(
            f"{owner}({name}=...): {name} must be None or {accepted}, got {type(value).__name__}"
        )


def _prefixed(owner: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{owner}: {exc}") from None


@dataclass(frozen=True)
class SessionSettings:
    """A strategy's RoundPipe arguments (documented on
    :class:`~roundpipe_lightning.RoundPipeStrategy`), checked once by :meth:`of`; ``owner``
    names the strategy in messages."""

    owner: str
    loss_reduction: str = "mean"
    num_microbatch: int | None = None
    execute_plan: ModelExecutePlan | str | Mapping[str, Any] | None = None
    optim_dtype: torch.dtype | None = torch.float32
    pin_model: str = "alloc"
    async_step: bool | None = None
    fuse_optimizer: bool = True
    overlap_iterations: bool = True
    recompute_grain: str | None = None
    preserve_rng_state: bool = True
    model_run_config: RoundPipeRunConfig | None = None
    grad_reduce_op: str = "mean"
    overlap_grad_reduce: bool = True
    process_group_timeout: float | timedelta | None = None  # resolved by of(): a timedelta
    shard_host_state: bool = False
    offload_dir: str | os.PathLike[str] | None = None

    @classmethod
    def of(
        cls, owner: str, arguments: Mapping[str, Any], fixed: Mapping[str, Any] = {}
    ) -> SessionSettings:
        """The checked settings of keyword ``arguments`` (any field but ``owner`` and the
        ``fixed`` ones)."""
        unknown = sorted(set(arguments) - SETTINGS.difference(fixed))
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
        defaults = {f.name: f.default for f in fields(cls) if f.name in SETTINGS}
        a = {**defaults, **arguments, **fixed}
        check_choice("loss_reduction", a["loss_reduction"], LOSS_REDUCTIONS, owner)
        # the core's vocabularies, not copies of them
        check_choice("pin_model", a["pin_model"], _values(PinMode), owner)
        check_choice(
            "recompute_grain", a["recompute_grain"], (*_values(RecomputeGrain), None), owner
        )
        check_choice("grad_reduce_op", a["grad_reduce_op"], REDUCE_OPS, owner)
        accepted = "a RoundPipeRunConfig"
        check_type(
            "model_run_config", a["model_run_config"], (RoundPipeRunConfig,), accepted, owner
        )
        accepted = "'auto', a ModelExecutePlan, a layout string or a dict of from_layout arguments"
        check_type(
            "execute_plan", a["execute_plan"], (ModelExecutePlan, str, Mapping), accepted, owner
        )
        check_num_microbatch(a["num_microbatch"], owner)
        a["optim_dtype"] = _prefixed(owner, lambda: parse_dtype(a["optim_dtype"]))
        check_bool("async_step", a["async_step"], owner, none="follows the hardware")
        for f in fields(cls):
            if isinstance(f.default, bool):  # the switches
                check_bool(f.name, a[f.name], owner)
        timeout = a["process_group_timeout"]
        a["process_group_timeout"] = _prefixed(owner, lambda: D.resolve_timeout(timeout))
        if a["offload_dir"] is not None:
            _prefixed(owner, lambda: check_offload_args(a["offload_dir"], None, True))
            if a["shard_host_state"]:
                raise ValueError(
                    f"{owner}(offload_dir=..., shard_host_state=True): the disk tier keeps "
                    "every master and its optimizer state in files of one process; sharding "
                    "them over processes is not supported. Pass one of the two."
                )
        return cls(owner=owner, **a)

    def resolve_async_step(self, devices: Sequence[torch.device]) -> bool:
        """``async_step``, or for None whether the pool is GPUs (on CPU workers the
        optimizer thread would compete with them for the cores)."""
        return self.async_step if self.async_step is not None else devices[0].type != "cpu"

    def check_processes(self, world_size: int) -> None:
        """Refuse ``offload_dir`` with several processes: the data parallel works on
        resident masters."""
        if self.offload_dir is not None and world_size > 1:
            raise ValueError(
                f"{self.owner}(offload_dir=...) runs in one process: the disk tier's masters "
                f"are not resident, and {world_size} processes (num_nodes) would broadcast "
                "and reduce them. Train on one node, or drop offload_dir."
            )

    def data_parallel(self) -> D.DataParallel:
        return _prefixed(
            self.owner,
            lambda: D.DataParallel(
                op=self.grad_reduce_op,
                overlap=self.overlap_grad_reduce,
                timeout=self.process_group_timeout,
                shard_host_state=self.shard_host_state,
            ),
        )

    def build_roundpipe(
        self, module: nn.Module, name: str, devices: list[torch.device], source: str, hint: str
    ) -> RoundPipe | AutoRoundPipe:
        """The RoundPipe a strategy trains: ``module`` (:func:`network_of`) on ``devices``,
        with ``execute_plan`` set for ``forward_backward``; ``source`` and ``hint`` word
        the messages. A synchronous step may update the weights in place, so with
        ``async_step=False`` parameters already in ``optim_dtype`` are their own masters
        (not with ``offload_dir``, whose masters live in its files)."""
        net, original = network_of(module, source)
        cfg = self.model_run_config or RoundPipeRunConfig()
        if self.num_microbatch is not None:
            cfg = replace(cfg, num_microbatch=self.num_microbatch)
        if self.recompute_grain is not None:
            cfg = replace(cfg, recompute_grain=self.recompute_grain)
        cfg = replace(cfg, preserve_rng_state=self.preserve_rng_state)
        common: dict[str, Any] = dict(
            optim_dtype=self.optim_dtype,
            name=name,
            model_run_config=cfg,
            pin_model=self.pin_model,
            devices=f"cpu:{len(devices)}" if devices[0].type == "cpu" else devices,
        )
        if isinstance(net, nn.Sequential):
            rp: RoundPipe | AutoRoundPipe = RoundPipe(
                net,
                original_model=original,
                loss_reduction=self.loss_reduction,
                # the disk tier keeps every master in its files: never the weight itself
                shared_masters=self.offload_dir is None and not self.resolve_async_step(devices),
                offload_dir=self.offload_dir,
                **common,
            )
        elif self.offload_dir is not None:
            raise ValueError(
                f"{self.owner}(offload_dir=...) needs an nn.Sequential (or a model a preset "
                f"converts to one); {source} a {type(net).__name__}, which would be split "
                "automatically (AutoRoundPipe), whose units have no disk tier. Give an "
                "nn.Sequential of its layers, or drop offload_dir."
            )
        else:
            rp = self._split(net, common, source, hint)
        if isinstance(rp, RoundPipe):  # (an AutoRoundPipe has no fused call to plan)
            try:
                plan = resolve_execute_plan(self.execute_plan, rp, "fused", self.owner)
                if plan is not None:
                    rp.set_plan("fused", plan)
            except BaseException:
                rp.close()
                raise
        return rp

    def _split(
        self, net: nn.Module, common: dict[str, Any], source: str, hint: str
    ) -> RoundPipe | AutoRoundPipe:
        """The automatic split of a module that is no ``nn.Sequential``, said once."""
        rp = auto_wrap(net, **common)
        kind = type(net).__name__
        said = (
            f"{source} a {kind}: not an nn.Sequential, and no preset or the converter by "
            "structure converts it (the log of roundpipe_core.presets says why), so RoundPipe "
            "splits it automatically: "
        )
        if not isinstance(rp, RoundPipe) and self.execute_plan is not None:
            rp.close()
            raise ValueError(
                f"{self.owner}(execute_plan=...) plans an nn.Sequential; the {kind} ({source} it) "
                "is split automatically into units (AutoRoundPipe), which have no such plan. Drop "
                "execute_plan, or give an nn.Sequential."
            )
        if isinstance(rp, RoundPipe):
            rp.loss_reduction = self.loss_reduction
            rank_zero_info(said + f"a chain of {rp.num_layers} layers, pipelined as a Sequential.")
            return rp
        rank_zero_warn(
            f"{said}AutoRoundPipe: {rp.summary()}; the code between the units runs on the "
            f"host, slower, and there is no forward_backward: {hint}. For full speed give an "
            f"nn.Sequential of its layers, or register_preset({kind!r}, lambda model: "
            "nn.Sequential(...)) from roundpipe_core.presets (docs/add-a-preset.md)."
        )
        return rp


#: the argument names
SETTINGS = frozenset(f.name for f in fields(SessionSettings)) - {"owner"}


class SessionHost:
    """A mixin: what both strategies read of their settings and devices; each setting a
    subclass does not define is a read-only attribute of it."""

    settings: SessionSettings
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    _checkpoint_io: CheckpointIO | None
    _num_nodes = 1  # Fabric's connector sets it directly
    _entry = "Trainer"  # what the messages tell the user to configure

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in SETTINGS:
            if not hasattr(cls, name):
                getter = functools.partial(lambda name, self: getattr(self.settings, name), name)
                setattr(cls, name, property(getter, doc=f"The ``{name}`` setting."))

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    def set_world_ranks(self) -> None:
        """One rank per node (the Trainer's connector calls it; Fabric's, _set_world_ranks)."""
        env = self.cluster_environment
        if env is not None and self.num_nodes > 1:
            env.set_global_rank(env.node_rank())
            env.set_world_size(self.num_nodes)
        rank = env.global_rank() if env is not None else 0
        rank_zero_only.rank = rank  # type: ignore[attr-defined]

    _set_world_ranks = set_world_ranks

    def check_launch(self, processes: int | None = None) -> ClusterEnvironment | None:
        """The cluster environment, after refusing several processes on one node (each
        would claim all of its devices), several nodes in a process no launcher started,
        a pool not all CPU workers or all CUDA GPUs, and what the settings cannot run in
        ``processes`` (default: the environment's world size)."""
        owner, entry, env = self.settings.owner, self._entry, self.cluster_environment
        num_nodes, devices = self.num_nodes, self.compute_devices
        if processes is None:
            processes = env.world_size() if env is not None else 1
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "1")
        local_rank = env.local_rank() if env is not None else 0
        crowded = None  # what shows that the launcher started several processes on this node
        if local_world.isdigit() and int(local_world) > 1:
            crowded = f"LOCAL_WORLD_SIZE={local_world}"
        elif local_rank > 0:
            crowded = f"LOCAL_RANK={local_rank}"
        elif processes > num_nodes:
            crowded = f"{processes} processes (WORLD_SIZE) for num_nodes={num_nodes}"
        if crowded is not None:
            raise ValueError(
                f"{owner} runs one process per node, and that process drives all of the node's "
                f"devices ({entry}(devices={len(devices)})); this process is one of several on its node "
                f"({crowded}), so each would claim the same devices. Launch one process per node: "
                "on one machine plain `python train.py` (no torchrun); on N machines `torchrun "
                f"--nnodes N --nproc-per-node 1 train.py` with {entry}(num_nodes=N), or `srun "
                "--ntasks-per-node=1`."
            )
        if num_nodes > 1 and (env is None or not env.creates_processes_externally):
            raise ValueError(
                f"{owner} with num_nodes={num_nodes} runs one process per node, started by a "
                "launcher (torchrun --nproc-per-node 1, srun with one task per node, or the "
                "MASTER_ADDR / WORLD_SIZE / NODE_RANK environment); this process was not."
            )
        kinds = {d.type for d in devices}
        if not kinds <= {"cpu", "cuda"} or len(kinds) != 1:
            raise ValueError(
                f"{owner} runs on CPU workers or CUDA GPUs, got devices {devices}; "
                f"use {entry}(accelerator='cpu' or 'gpu', devices=N)"
            )
        if devices[0].type == "cpu" and len(devices) == 1:
            # devices="auto" on CPU is one device: training works but nothing overlaps
            log.warning(
                f"{owner} runs on 1 CPU worker (what {entry}(devices='auto') gives on "
                "CPU): one worker runs every stage in turn, so nothing is pipelined. Pass "
                f"{entry}(accelerator='cpu', devices=N) with N >= 2 for N workers (they share this "
                "machine's cores); RoundPipe used without Lightning takes devices=N or reads "
                "ROUNDPIPE_CPU_DEVICES."
            )
        self.settings.check_processes(processes)
        return env

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """:class:`StreamingCheckpointIO` unless a ``checkpoint_io`` was given."""
        if self._checkpoint_io is None:
            self._checkpoint_io = StreamingCheckpointIO()
        elif isinstance(self._checkpoint_io, WrappingCheckpointIO):
            # an AsyncCheckpointIO without its own inner IO (the setter keeps a configured one)
            self._checkpoint_io.checkpoint_io = StreamingCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    def compute_devices(self) -> list[torch.device]:
        """The devices of this process's RoundPipe pool (the Trainer's / Fabric's ``devices``)."""
        return list(self.parallel_devices or [torch.device("cpu")])

    @property
    def async_step(self) -> bool:
        """Whether the optimizer step overlaps the next iteration (resolved)."""
        return self.settings.resolve_async_step(self.compute_devices)


def network_of(net: nn.Module, source: str) -> tuple[nn.Module, Any]:
    """``(network, original)``: an ``nn.Sequential`` as it is, a model a preset converts
    with itself as ``original``, any other as it is (split automatically)."""
    if isinstance(net, nn.Sequential):
        if len(net) == 0:
            raise ValueError(f"{source} an empty nn.Sequential; give it layers")
        return net, None
    from roundpipe_core.presets import convert_if_possible

    # a preset, else the converter by structure (it logs why it refuses a model)
    seq = convert_if_possible(net)
    return (seq, net) if seq is not None else (net, None)


def op_name(reduce_op: Any) -> str:
    """Lightning's ``reduce_op`` ("avg", ``ReduceOp.SUM``, None, ...) as a core op name."""
    if reduce_op is None:
        return "sum"
    name = reduce_op if isinstance(reduce_op, str) else str(getattr(reduce_op, "name", reduce_op))
    name = name.lower().rsplit(".", 1)[-1]
    return {"avg": "mean", "prod": "product"}.get(name, name)


def all_reduce(tensor: Any, group: Any, reduce_op: Any) -> Any:
    if not isinstance(tensor, Tensor):
        return tensor
    return D.all_reduce(tensor, op_name(reduce_op), group)


# -- set-up --------------------------------------------------------------------------------------
#: parameter-sized states per parameter assumed for an optimizer the host-memory table
#: does not know: Adam's two moments, more than most optimizers keep
ASSUMED_OPTIMIZER_STATES = 2

# reasons already logged: one line per optimizer class and reason, not one per run
_SAID: set[tuple[str, str]] = set()


# -- optimizers ----------------------------------------------------------------------------------
def point_at_masters(opt: Optimizer, rp: RP, build_hint: str = "self.parameters()") -> None:
    """Replace the parameters in ``opt``'s groups by their masters. LBFGS is refused:
    its ``step()`` re-evaluates the loss, which a queued step cannot."""
    if isinstance(opt, torch.optim.LBFGS):
        raise TypeError(
            "LBFGS re-evaluates the loss inside optimizer.step(), which RoundPipe's (asynchronous) "
            "step cannot do; choose another optimizer"
        )
    masters = {id(p): m for p in rp.model.parameters() if (m := rp.master_param(p)) is not None}
    adopted = 0
    for group in opt.param_groups:
        new, seen = [], set()
        for p in group["params"]:
            m = masters.get(id(p), p)
            adopted += id(p) in masters  # a shared master is the parameter itself
            if id(m) not in seen:
                seen.add(id(m))
                new.append(m)
        group["params"] = new
    if adopted == 0 and any(len(g["params"]) for g in opt.param_groups) and masters:
        rank_zero_warn(
            f"{type(opt).__name__} holds none of the parameters of the network RoundPipe runs; "
            f"RoundPipe will not train it. Build it from {build_hint}."
        )


def fuse_optimizer(opt: Optimizer) -> None:
    """Switch ``opt`` in place (LR schedulers keep working) to torch's fused CPU kernel
    where the user left ``fused`` unset (:func:`roundpipe_core.optim.use_fastest_`);
    else log why once."""
    # (use_fastest_ leaves an explicit fused= / foreach= as it is)
    if any(g.get("fused") for g in opt.param_groups) or use_fastest_(opt):
        return
    reason = why_not_faster(opt)
    key = (type(opt).__qualname__, reason)
    if key not in _SAID:
        _SAID.add(key)
        rank_zero_info(f"RoundPipeStrategy runs {type(opt).__name__} unfused: {reason}")


IMPL_KEYS = ("fused", "foreach")


def restore_impl_choice(state: dict[str, Any], choice: list[dict[str, Any]] | None) -> None:
    """The user's ``fused`` / ``foreach`` back into an optimizer ``state_dict()`` (else
    plain Lightning would resume it fused)."""
    groups = state.get("param_groups")
    if choice is None or not isinstance(groups, list) or len(groups) != len(choice):
        return
    for group, own in zip(groups, choice):
        for key in IMPL_KEYS:
            if key in own:
                group[key] = own[key]
            else:
                group.pop(key, None)


# -- the loss --------------------------------------------------------------------------------------
def reaches_params(loss: Tensor, params: set[int]) -> int | None:
    """The id of one of ``params`` that ``loss``'s graph accumulates into, or None."""
    stack, seen = [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if var is not None and id(var) in params:
            return id(var)
        stack.extend(f for f, _ in fn.next_functions)
    return None


_DIRECT_CALL = (
    "the loss's autograd graph reaches the parameter {param!r} of the network "
    "configure_sequential() returned, whose gradients never reach the master copies "
    "the optimizer steps. Either the network was called directly (e.g. self.net(x) or "
    "self.model(**batch).loss): call it through self.roundpipe instead -- "
    "loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=...) or "
    "out = self.roundpipe(x) -- or a term of the loss uses its weights (an L2 penalty "
    "over self.parameters()): use the optimizer's weight_decay, or add the penalty's "
    "gradient to the optimizer's parameters (the masters) in on_before_optimizer_step"
)


def check_loss_went_through(loss: Tensor, rp: RP, message: str = _DIRECT_CALL) -> None:
    """Refuse a loss whose graph reaches the network's own parameters: it ran outside
    RoundPipe, and training would silently do nothing (``message``: what to call
    instead; ``{param}``: the parameter reached)."""
    names = {id(p): name for name, p in rp.model.named_parameters()}
    if isinstance(rp, AutoRoundPipe):  # its glue code uses these on the host, legitimately
        for _, p in rp.host_parameters:
            names.pop(id(p), None)
    reached = reaches_params(loss, set(names)) if loss.requires_grad else None
    if reached is None:
        return
    text = message.replace("{param!r}", repr(names[reached]))
    if isinstance(rp, AutoRoundPipe):
        param = next(p for p in rp.model.parameters() if id(p) == reached)
        unit = rp.unit_of(param)
        if unit is not None:
            # the model's own code cannot be the cause: AutoRoundPipe.forward finds the host
            # code's uses of a unit's parameter and trains them (autosplit.HostReads)
            text += (
                f". (It is a parameter of the automatic split's unit {unit or '<root>'!r}; uses of "
                "it by the model's own code inside self.roundpipe(...) are found and trained, so "
                "this graph was built outside that call.)"
            )
    raise RuntimeError(text)


# -- the step --------------------------------------------------------------------------------------
class StepLedger:
    """Optimizer steps in flight and lost (training and optimizer threads). Lightning
    counts a step when it is queued; ``lost`` is what a checkpoint must take back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unapplied = 0
        self._lost = 0
        self._failed = False

    def queued(self) -> None:
        with self._lock:
            self._unapplied += 1

    def applied(self) -> None:
        with self._lock:
            self._unapplied -= 1

    def mark_failed(self) -> None:
        with self._lock:
            self._failed = True

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Marks the step failed where the block raises (optimizer thread)."""
        try:
            yield
        except BaseException:
            self.mark_failed()
            raise

    @property
    def step_failed(self) -> bool:
        with self._lock:
            return self._failed

    def take_back(self) -> int:
        """After a failure, nothing in flight: the unapplied steps are lost (how many)."""
        with self._lock:
            lost, self._unapplied, self._failed = self._unapplied, 0, False
            self._lost += lost
            return lost

    @property
    def lost(self) -> int:
        with self._lock:
            return self._lost

    def reset(self) -> None:
        with self._lock:
            self._unapplied = self._lost = 0
            self._failed = False


_MISSING = object()

# not taken over by a twin: its own groups, and an LR scheduler's per-instance step
# wrapper (bound to the user's object, it would step that one)
_NOT_SHARED = ("param_groups", "step")

_WARNED: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def _frozen(value: Any) -> Any:
    # schedulers update tensor learning rates in place (``lr.fill_``)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class QueuedStep:
    """``optimizer.step(**kwargs)`` with the hyperparameters the param groups hold now.

    An LR scheduler may write the *next* step's values into the live groups before a
    queued step runs, so the groups are copied when it is queued (on the main thread)
    and the step runs on a *twin*: an instance of the same class sharing everything with
    the user's optimizer but ``param_groups``; what the step writes into its groups or
    rebinds on the twin (step counters) is carried back. A ``step`` set on the instance:
    an LR scheduler's wrapper gives way to the class's, a method of the optimizer is
    bound to the twin, any other callable runs on the live optimizer with a warning.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        live = optimizer.param_groups
        self.hyper = [{k: _frozen(v) for k, v in g.items() if k != "params"} for g in live]
        self.groups = [{**h, "params": g["params"]} for h, g in zip(self.hyper, live)]
        self.live = list(live)

    def _twin(self, own_step: types.MethodType | None) -> tuple[Optimizer, dict[str, Any]]:
        """The twin (``own_step`` bound to it), and the attributes it started with."""
        opt = self.optimizer
        shared = {k: v for k, v in vars(opt).items() if k not in _NOT_SHARED}
        twin = object.__new__(type(opt))
        vars(twin).update(shared)
        vars(twin)["param_groups"] = self.groups
        if own_step is not None:
            vars(twin)["step"] = types.MethodType(own_step.__func__, twin)
        return twin, shared

    def optimizer_for_step(self) -> tuple[Optimizer, Callable[[], None]]:
        """The optimizer the step runs on (the twin, or with a warning the live one), and
        what to call once the whole step ran (carries back what it wrote)."""
        opt = self.optimizer
        own = vars(opt).get("step")  # an LR scheduler's wrapper gives way to the class's
        if own is not None and is_lr_scheduler_step_wrapper(own):
            own = None
        if own is not None and not (isinstance(own, types.MethodType) and own.__self__ is opt):
            if opt not in _WARNED:
                _WARNED.add(opt)
                warnings.warn(
                    f"{type(opt).__name__}.step was replaced on the instance; with "
                    "RoundPipeStrategy(async_step=True) it runs on the optimizer thread and "
                    "reads the live param_groups, so a hyperparameter an LR scheduler sets for "
                    "the next step may already be seen. Override step in a subclass instead.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return opt, lambda: None
        twin, before = self._twin(own)
        return twin, functools.partial(self._carry_back, twin, before)

    def _carry_back(self, twin: Optimizer, before: dict[str, Any]) -> None:
        # attributes the step rebound on the twin (counters kept outside the groups)
        target = vars(self.optimizer)
        for key, value in vars(twin).items():
            if key not in _NOT_SHARED and before.get(key, _MISSING) is not value:
                target[key] = value
        # entries the step wrote into its groups (step counters of some optimizers)
        for h, g, live in zip(self.hyper, self.groups, self.live):
            for key, value in g.items():
                if key != "params" and (key not in h or h[key] is not value):
                    live[key] = value

    def run(self, params: Sequence[Tensor] | None = None, **kwargs: Any) -> Any:
        opt, done = self.optimizer_for_step()
        out = opt.step(**kwargs) if params is None else step_subset(opt, params, **kwargs)
        done()
        return out


# -- one RoundPipe being trained -----------------------------------------------------------------
class Session:
    """One RoundPipe being trained; ``module`` names the parameters in checkpoints (the
    LightningModule, or what was given to ``fabric.setup()``)."""

    def __init__(
        self,
        settings: SessionSettings,
        rp: RP,
        module: nn.Module,
        dp: D.DataParallel,
        async_step: bool,
    ) -> None:
        self.settings, self.rp, self.module, self.dp = settings, rp, module, dp
        self.async_step = async_step
        self.optimizers: list[Optimizer] = []
        #: per optimizer (by id): its own ``zero_grad``, which the queued step calls
        self.real_zero_grad: dict[int, Callable[..., None]] = {}
        #: per optimizer (by id): the ``fused`` / ``foreach`` the user built it with
        self.user_impl: dict[int, list[dict[str, Any]]] = {}
        self.steps = StepLedger()
        #: the disk tier (``offload_dir``): the masters and the optimizer state in files
        self.tier: DiskTier | None = getattr(rp, "disk_tier", None)

    def summary(self) -> str:
        """The set-up line: pool, plan, microbatches, step mode."""
        rp, workers = self.rp, self.rp.pool.workers
        n = len(workers)
        if rp.pool.is_cuda:
            pool = f"{n} GPU{'s' if n != 1 else ''} ({', '.join(str(w.device) for w in workers)})"
        else:
            pool = f"{n} CPU worker{'s' if n != 1 else ''}"
        if isinstance(rp, RoundPipe):
            m = rp.num_microbatch_for(self.settings.num_microbatch)
            layout = rp.plan_for("fused").to_layout_string()
            plan = f'plan "{layout}", {m} microbatch{"es" if m != 1 else ""}'
        else:
            plan = f"{len(rp.units)} units split automatically"
        step = "asynchronous (one step stale)" if self.async_step else "synchronous"
        if self.settings.async_step is None:
            step += " (async_step=None follows the hardware; pass True or False to choose)"
        return f"{self.settings.owner}: {pool}, {rp.num_layers} layers, {plan}; step {step}"

    def check_host_budget(self) -> None:
        """Say the set-up line and the host-memory budget (the whole table at DEBUG), and
        refuse, with numbers, a run whose state cannot fit. An optimizer of unknown state
        size does not stop training: the budget assumes Adam's and says so once."""
        rp, dp, opts, settings = self.rp, self.dp, self.optimizers, self.settings
        common: dict[str, Any] = dict(
            num_microbatch=settings.num_microbatch,
            state_shards=dp.state_shards,
            async_step=self.async_step,
            collective_buffers=dp.kept_buffer_bytes(rp, opts),
        )
        try:
            budget = estimate_host_memory(rp, optimizer=opts, **common)
        except UnknownOptimizerError as exc:
            names = ", ".join(sorted({type(o).__name__ for o in opts}))
            if ("budget", names) not in _SAID:
                _SAID.add(("budget", names))
                rank_zero_warn(
                    f"RoundPipe cannot tell how much state {names} keeps ({exc}); the host-memory "
                    f"budget assumes {ASSUMED_OPTIMIZER_STATES} parameter-sized tensors per parameter"
                )
            budget = estimate_host_memory(rp, optimizer_states=ASSUMED_OPTIMIZER_STATES, **common)
        available = available_host_memory()
        rank_zero_info(self.summary())
        rank_zero_info(f"{settings.owner}: {budget.summary(available)}")
        rank_zero_debug(f"RoundPipe host memory:\n{budget}")
        check_host_memory(budget, available)

    # -- optimizers ----------------------------------------------------------------------------
    def adopt(
        self,
        opt: Optimizer,
        zero_grad: Callable[..., None] | None = None,
        build_hint: str = "self.parameters()",
    ) -> None:
        """Point ``opt`` at the masters, fuse it, and make ``zero_grad`` (default: a no-op)
        its ``zero_grad``; the queued step calls the real one (:func:`defer_zero_grad`)."""
        self.user_impl[id(opt)] = [{k: g[k] for k in IMPL_KEYS if k in g} for g in opt.param_groups]
        point_at_masters(opt, self.rp, build_hint)
        if self.settings.fuse_optimizer:
            fuse_optimizer(opt)  # on the masters (host, fp32)
        tier = self.tier
        if tier is not None and all(o is not opt for o in self.optimizers):
            if self.optimizers:
                raise ValueError(
                    f"{self.settings.owner}(offload_dir=...) keeps one optimizer's state in "
                    "its files; configure one optimizer over all the parameters"
                )
            # the tier's optimizer from now on; refused here, at setup, if it cannot stream
            # it (not elementwise, or over tensors that are not the masters)
            _prefixed(self.settings.owner, lambda: tier.streamed(self._tier_step(opt)))
        if id(opt) not in self.real_zero_grad:
            self.real_zero_grad[id(opt)] = defer_zero_grad(opt, zero_grad)
        if all(o is not opt for o in self.optimizers):
            self.optimizers.append(opt)

    def queue_step(
        self,
        opt: Optimizer,
        kwargs: dict[str, Any],
        update: bool = True,
        clip: Callable[[], None] | None = None,
        reduce_first: bool = False,
        layerwise: bool = False,
    ) -> None:
        """Hand ``opt.step(**kwargs)`` with the hyperparameters of now to the RoundPipe
        (``update=False``: a skipped step, only the clearing). On the optimizer thread,
        once the calls before it are in: ``reduce_first`` reduces the gradients
        (collective: every process queues every step, skipped ones too), ``clip`` runs,
        then the step; ``layerwise`` (one process) steps the deepest layers while the
        backward still runs, as ``offload_dir`` always does, paging from its files."""
        steps, dp = self.steps, self.dp
        reduce_first = reduce_first and dp.world_size > 1
        layerwise = layerwise and not reduce_first
        # the hyperparameters of now, before an LR scheduler writes the next step's
        queued = QueuedStep(opt) if self.async_step and update else None
        zero_grad = self.real_zero_grad.get(id(opt), opt.zero_grad)

        def update_params(params: Sequence[Tensor] | None = None) -> None:
            with steps.failing():
                if params is None and clip is not None:
                    clip()
                if queued is not None:
                    queued.run(params, **kwargs)
                elif update:
                    opt.step(**kwargs)

        def finish() -> None:
            with steps.failing():
                zero_grad(set_to_none=True)
                dp.after_step(opt)  # sharded: all-gather the weights each process stepped
            if update:
                steps.applied()

        def whole() -> None:
            if reduce_first:
                with steps.failing():
                    dp.reduce(opt)
            update_params()
            finish()

        if update:
            mark_lr_scheduler_step_called(opt)
            steps.queued()
        if self.tier is not None and not update:
            self.rp.after_step(finish)  # the clearing, in step order
        elif self.tier is not None:
            target, done = (
                queued.optimizer_for_step() if queued is not None else (opt, lambda: None)
            )

            def finished() -> None:
                done()
                finish()

            self.rp.step_layerwise(self._tier_step(target), finished, is_async=self.async_step)
        elif layerwise and queued is not None:
            self.rp.step_layerwise(update_params, finish)
        else:
            self.rp.step(whole, is_async=self.async_step)

    @staticmethod
    def _tier_step(opt: Optimizer) -> functools.partial:
        # the one form of step the disk tier streams (it reads the optimizer out of it)
        return functools.partial(step_subset, opt)

    # -- checkpoints ---------------------------------------------------------------------------
    def named_masters(self) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """(name, parameter, master) of every trainable parameter."""
        named = self.module.named_parameters()
        return [(name, p, m) for name, p in named if (m := self.rp.master_param(p)) is not None]

    def masters_by_name(self) -> dict[str, nn.Parameter]:
        return {name: m for name, _, m in self.named_masters()}

    def optimizer_state(self, opt: Optimizer, full: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What a checkpoint holds of ``opt``: ``full()`` with the user's fused / foreach,
        or, sharded, the marker of the shards."""
        shard = self.dp.shard(opt)
        if shard is not None:
            return marker(shard.world_size)
        # the disk tier's: the same state dict, its tensors mapping the tier's files
        state = self.tier.optimizer_state_dict(opt) if self.tier is not None else full()
        restore_impl_choice(state, self.user_impl.get(id(opt)))
        return state

    def section(self, optimizers: Sequence[Any], loss_scaler: Any = None) -> dict[str, Any]:
        """``checkpoint["roundpipe"]``: the masters whose dtype differs from their
        parameter's (live tensors, not copies; a sharded optimizer's are in its shards),
        the loss scaler, the layer timer and which stages draw random numbers."""
        in_shards = sharded_masters(self.dp, optimizers)
        values: Mapping[str, Tensor] = {}
        if self.tier is not None:  # mapping its files, valid until the second step from now
            files = self.tier.masters_state()
            values = {name: files[key] for name, key in self._tier_names().items()}
        masters = {
            name: values.get(name, m).detach()
            for name, p, m in self.named_masters()
            if m.dtype != p.dtype and id(m) not in in_shards
        }
        state: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "masters": masters}
        if loss_scaler is not None:
            state["loss_scaler"] = loss_scaler.state_dict()
        if isinstance(self.rp, RoundPipe):  # an AutoRoundPipe's units time themselves
            state["timer"] = self.rp.model_timer.state_dict()
            state["draws"] = self.rp.pool.learned_draws(self.rp.layers)
        return state

    def _tier_names(self) -> dict[str, str]:
        """{parameter name: the disk tier's name of its master}."""
        of_master = {id(m): name for name, _, m in self.rp.masters.copies}
        return {name: of_master[id(m)] for name, _, m in self.named_masters() if id(m) in of_master}

    def save_shard(self, opt: Optimizer, directory: Path) -> None:
        """Every rank, sharded: its share of ``opt``'s state (with the user's fused /
        foreach) into ``directory``; nothing for an optimizer that is not sharded."""
        shard = self.dp.shard(opt)
        if shard is None:
            return
        choice = self.user_impl.get(id(opt))
        named = of_optimizer(self.masters_by_name(), opt)
        D.save_shard(
            directory,
            named,
            opt,
            shard.owns,
            shard.rank,
            shard.world_size,
            edit_groups=lambda groups: restore_impl_choice({"param_groups": groups}, choice),
        )

    def load_optimizer(self, opt: Optimizer, state: Any, directory: Path | None) -> None:
        """Restore ``opt`` from ``state``: a state dict (into the disk tier's files where
        there is one), or the marker of the shards in ``directory``
        (:func:`~roundpipe_lightning.sharded_checkpoint.load_optimizer_state`); then
        :meth:`check_optimizer_states`."""
        if self.tier is None:
            named = self.masters_by_name()
            load_optimizer_state(directory, opt, state, self.dp.shard(opt), named)
        elif is_marker(state):
            raise ValueError(
                f"{self.settings.owner}(offload_dir=...): this checkpoint's optimizer state is "
                "sharded across processes; merge it first with roundpipe_lightning."
                "sharded_checkpoint.convert_sharded_checkpoint(path, out)"
            )
        else:
            self.tier.load_state(None, opt, state)
        if self.settings.fuse_optimizer:  # a checkpoint of an unfused run has fused=None
            fuse_optimizer(opt)
        self.check_optimizer_states([opt])

    def load_masters(self, saved: Mapping[str, Tensor], from_weights: bool = True) -> None:
        """Each master becomes its saved value, else (``from_weights``, after the weights
        were loaded) its weight, its gradient dropped; otherwise (restored from shards)
        as it is. Another process's share is left to its shard."""
        if self.tier is not None:
            # the saved ones, else (from_weights) each from its weight: a new generation
            if saved or from_weights:
                names = self._tier_names()
                # a generation holds masters and state: the optimizer's is kept as it is
                opt = self.optimizers[0] if self.optimizers else None
                kept = self.tier.optimizer_state_dict(opt) if opt is not None else None
                masters = {names[n]: t for n, t in saved.items() if n in names}
                self.tier.load_state(masters, opt, kept)
            if from_weights:
                for _, _, m in self.named_masters():
                    m.grad = None
            return
        released = self.rp.masters.released
        with torch.no_grad():
            for name, p, m in self.named_masters():
                if id(m) in released:
                    pass
                elif name in saved:
                    m.copy_(saved[name])
                elif from_weights and m is not p:
                    m.copy_(p)
                if from_weights:
                    m.grad = None

    def load_section(
        self,
        section: Any,
        strict: bool,
        load_weights: Callable[[], None] | None = None,
        loss_scaler: Any = None,
    ) -> None:
        """Restore a checkpoint's section, checked before anything (``load_weights``: the
        module's weights, which the masters then follow) is loaded, so a bad file leaves
        the model as it was: the masters, the loss scaler, what the RoundPipe learned."""
        params = {name: p for name, p, _ in self.named_masters()}
        saved = check_roundpipe_section(section, params, strict=strict)
        if load_weights is not None:
            load_weights()
        self.load_masters(saved, from_weights=load_weights is not None)
        state = section or {}
        if loss_scaler is not None and "loss_scaler" in state:
            loss_scaler.load_state_dict(state["loss_scaler"])
        if isinstance(self.rp, RoundPipe):  # the layer timer, the stages' draws
            restore_learned(self.rp, state)

    def check_optimizer_states(self, optimizers: Sequence[Optimizer] | None = None) -> None:
        """Each state tensor of ``optimizers`` (default: all) has its parameter's shape
        (fused kernels do not check)."""
        names = {id(m): name for name, _, m in self.named_masters()}
        for opt in self.optimizers if optimizers is None else optimizers:
            check_state_matches(opt, names)

    # -- end -------------------------------------------------------------------------------------
    def close(self, failed: bool = False) -> None:
        """Stop the RoundPipe (after a failure its error is only logged) and release."""
        try:
            self.rp.close()
        except BaseException as exc:
            if not failed:
                raise
            log.debug("RoundPipe.close() after a failure raised: %r", exc)
        finally:
            self.release()

    def release(self) -> None:
        """Give the optimizers their own ``zero_grad`` back."""
        for opt in self.optimizers:
            restore_zero_grad(opt)
        self.real_zero_grad.clear()
        self.optimizers.clear()
