"""Checks and conversions of RoundPipeStrategy's set-up: its constructor arguments,
what ``configure_sequential()`` returns, and the optimizers it points at the masters."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from roundpipe_core import RoundPipe
from roundpipe_core.optim import fastest_impl, use_fastest_
from roundpipe_core.running.host_memory import (
    HostMemoryBudget,
    UnknownOptimizerError,
    estimate_host_memory,
)

from ._private import defer_zero_grad, restore_zero_grad

__all__ = [
    "trainer_of",
    "raw_optimizer",
    "parse_dtype",
    "check_bool",
    "check_choice",
    "check_num_microbatch",
    "check_type",
    "check_plugins",
    "check_pool_devices",
    "sequential_of",
    "adopt_optimizer",
    "zero_grad_after_step",
    "order_manual_zero_grad",
    "release_optimizers",
    "fuse_optimizer",
    "user_impl_choice",
    "restore_impl_choice",
    "host_memory_budget",
    "op_name",
    "reaches_params",
    "check_loss_went_through",
]

log = logging.getLogger(__name__)


def trainer_of(lm: pl.LightningModule | None) -> pl.Trainer | None:
    """The Trainer ``lm`` is attached to, or None."""
    if lm is None:
        return None
    try:
        return lm.trainer
    except RuntimeError:  # "not attached to a Trainer"
        return None


def raw_optimizer(opt: Any) -> Optimizer:
    """The user's optimizer behind Lightning's ``LightningOptimizer`` wrapper."""
    return opt.optimizer if isinstance(opt, LightningOptimizer) else opt


#: parameter-sized states per parameter assumed for an optimizer the host-memory table
#: does not know: Adam's two moments, more than most optimizers keep
ASSUMED_OPTIMIZER_STATES = 2

# reasons already logged: one line per optimizer class and reason, not one per run
_SAID: set[tuple[str, str]] = set()

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


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
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


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool. No ``bool()`` coercion: ``"False"`` would become True."""
    if not isinstance(value, bool):
        raise TypeError(
            f"RoundPipeStrategy({name}={value!r}): {name} must be True or False (a bool), got "
            f"{type(value).__name__}; in YAML write true / false without quotes"
        )
    return value


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices`` (a clear TypeError / ValueError otherwise)."""
    kinds = {type(c) for c in choices if c is not None}
    if value is not None and not isinstance(value, tuple(kinds)):
        raise TypeError(
            f"RoundPipeStrategy({name}={value!r}): {name} must be one of {choices}, got "
            f"{type(value).__name__}"
        )
    if value not in choices:
        raise ValueError(f"RoundPipeStrategy({name}={value!r}): {name} must be one of {choices}")
    return value


def sequential_of(lm: pl.LightningModule) -> tuple[nn.Module, Any]:
    """Call ``configure_sequential()`` and check what it returned.

    Returns:
        ``(network, original)``: the module RoundPipe wraps and, when a preset converted
        a Hugging Face model, that model (else None).
    """
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


def adopt_optimizer(
    opt: Optimizer, rp: RoundPipe, real_zero_grad: dict[int, Callable[..., None]]
) -> None:
    """Point ``opt`` at ``rp``'s master copies and defer its ``zero_grad`` to the RoundPipe
    step (its own ``zero_grad`` is kept in ``real_zero_grad[id(opt)]``).

    Lightning zeroes the gradients *after* ``training_step`` in automatic optimization,
    which would wipe what ``forward_backward`` just produced; the queued step clears them
    right after the update instead.
    """
    if isinstance(opt, torch.optim.LBFGS):
        raise TypeError(
            "LBFGS re-evaluates the loss inside optimizer.step(), which RoundPipe's (asynchronous) "
            "step cannot do; choose another optimizer"
        )
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
            adopted += id(p) in masters  # a shared master is the parameter itself
            if id(m) not in seen:
                seen.add(id(m))
                new.append(m)
        group["params"] = new
    if adopted == 0 and any(len(g["params"]) for g in opt.param_groups) and masters:
        rank_zero_warn(
            f"{type(opt).__name__} holds none of the parameters of configure_sequential()'s network; "
            "RoundPipe will not train it. Build it from self.parameters()."
        )
    if id(opt) not in real_zero_grad:
        real_zero_grad[id(opt)] = defer_zero_grad(opt)


def zero_grad_after_step(rp: RoundPipe, real: Callable[..., None]) -> Callable[..., None]:
    """An optimizer's ``zero_grad`` that clears the gradients in order with ``rp``'s
    queued step (``RoundPipe.after_step``): after it has read them, never under it."""

    def zero_grad(set_to_none: bool = True) -> None:
        rp.after_step(functools.partial(real, set_to_none=set_to_none))

    return zero_grad


def order_manual_zero_grad(
    lm: pl.LightningModule, rp: RoundPipe, real_zero_grad: dict[int, Callable[..., None]]
) -> list[LightningOptimizer]:
    """Manual optimization: the user's ``opt.zero_grad()`` (on the LightningOptimizer or
    the optimizer itself) runs in order with the queued step, on the optimizer thread
    right after it -- clearing the masters' gradients while that step still reads them
    would lose its update. Returns the wrappers given the ordered ``zero_grad``."""
    wrappers = lm.optimizers(use_pl_optimizer=True)
    changed = []
    for wrapper in wrappers if isinstance(wrappers, list) else [wrappers]:
        raw = raw_optimizer(wrapper)
        real = real_zero_grad.get(id(raw))
        if real is None:
            continue
        in_order = zero_grad_after_step(rp, real)
        defer_zero_grad(raw, in_order)
        if wrapper is not raw:
            defer_zero_grad(wrapper, in_order)
            changed.append(wrapper)
    return changed


def release_optimizers(
    optimizers: list[Optimizer],
    real_zero_grad: dict[int, Callable[..., None]],
    wrappers: list[LightningOptimizer],
) -> None:
    """Give the optimizers (and LightningOptimizer wrappers) their own ``zero_grad``
    back (teardown); empties ``real_zero_grad`` and ``wrappers``."""
    for opt in optimizers:
        raw = raw_optimizer(opt)
        if id(raw) in real_zero_grad:
            restore_zero_grad(raw)
    real_zero_grad.clear()
    for wrapper in wrappers:
        restore_zero_grad(wrapper)
    wrappers.clear()


def op_name(reduce_op: ReduceOp | str | None) -> str:
    """Lightning's ``reduce_op`` ("mean", "avg", "sum", ``ReduceOp.SUM``, None) as the
    op name of :func:`roundpipe_core.distributed.all_reduce`."""
    if reduce_op is None:
        return "sum"
    name = reduce_op if isinstance(reduce_op, str) else str(getattr(reduce_op, "name", reduce_op))
    name = name.lower().rsplit(".", 1)[-1]
    return {"avg": "mean", "prod": "product"}.get(name, name)


def reaches_params(loss: Tensor, params: set[int]) -> int | None:
    """The id of one of ``params`` (by id) that ``loss``'s autograd graph accumulates
    into, or None."""
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


def check_num_microbatch(value: Any) -> int | None:
    """``value`` if it is None or an int >= 1."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f"RoundPipeStrategy(num_microbatch={value!r}): num_microbatch must be a positive int "
            f"or None, got {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"RoundPipeStrategy(num_microbatch={value!r}): num_microbatch must be >= 1 (or None "
            "for devices + 1)"
        )
    return value


def check_type(name: str, value: Any, types: tuple[type, ...], accepted: str) -> None:
    """A TypeError naming ``name`` unless ``value`` is None or one of ``types``."""
    if value is not None and not isinstance(value, types):
        raise TypeError(
            f"RoundPipeStrategy({name}=...): {name} must be None or {accepted}, got "
            f"{type(value).__name__}"
        )


def check_plugins(checkpoint_io: Any, precision_plugin: Any) -> None:
    """TypeErrors for a ``checkpoint_io`` / ``precision_plugin`` of the wrong kind (they
    would fail only at the first save or at teardown, or be silently ignored)."""
    check_type("checkpoint_io", checkpoint_io, (CheckpointIO,), "a lightning CheckpointIO")
    if isinstance(precision_plugin, (str, int)):
        raise TypeError(
            f"RoundPipeStrategy(precision_plugin={precision_plugin!r}): pass the precision to "
            f"the Trainer instead: Trainer(precision={precision_plugin!r}, strategy=...)"
        )
    check_type("precision_plugin", precision_plugin, (Precision,), "a lightning Precision plugin")


def check_pool_devices(devices: list[torch.device]) -> list[torch.device]:
    """``devices`` if they are all CPU workers or all CUDA GPUs; a single CPU worker
    gets a hint that nothing is pipelined and how to ask for more."""
    kinds = {d.type for d in devices}
    if not kinds <= {"cpu", "cuda"} or len(kinds) != 1:
        raise ValueError(
            f"RoundPipeStrategy runs on CPU workers or CUDA GPUs, got devices {devices}; "
            "use Trainer(accelerator='cpu' or 'gpu', devices=N)"
        )
    if devices[0].type == "cpu" and len(devices) == 1:
        # devices="auto" on CPU is one device: training works but nothing overlaps
        log.warning(
            "RoundPipeStrategy runs on 1 CPU worker (what Trainer(devices='auto') gives on "
            "CPU): one worker runs every stage in turn, so nothing is pipelined. Pass "
            "Trainer(accelerator='cpu', devices=N) with N >= 2 for N workers (they share this "
            "machine's cores); RoundPipe used without Lightning takes devices=N or reads "
            "ROUNDPIPE_CPU_DEVICES."
        )
    return devices


def _not_fused_reason(opt: Optimizer) -> str:
    """Why :func:`roundpipe_core.optim.use_fastest_` left ``opt`` as it is (for the log)."""
    torch_cls = next((c for c in type(opt).__mro__ if c.__module__.startswith("torch.optim")), None)
    if torch_cls is None:
        return "it is not a torch.optim optimizer"
    try:
        impl = fastest_impl(torch_cls.__name__)
    except ValueError:
        impl = "default"
    if impl != "fused":
        return f"torch has no fused CPU kernel for {torch_cls.__name__}"
    if type(opt) is not torch_cls and type(opt).__module__ != "roundpipe_core.optim":
        return f"it is a subclass of {torch_cls.__name__} that may rely on its own step()"
    groups = opt.param_groups
    if any(g.get("fused") is False or g.get("foreach") is not None for g in groups):
        return "the optimizer was built with an explicit fused=/foreach= choice, which is kept"
    if any(g.get("differentiable") or g.get("capturable") for g in groups):
        return "it was built with differentiable=True or capturable=True"
    return (
        "some of its parameters are not floating-point dense tensors on a device with the "
        "fused kernel"
    )


#: the param-group keys that choose torch's implementation (fuse_optimizer may set them)
IMPL_KEYS = ("fused", "foreach")


def user_impl_choice(opt: Optimizer) -> list[dict[str, Any]]:
    """Per param group, the ``fused`` / ``foreach`` values as the user built ``opt``."""
    return [{k: g[k] for k in IMPL_KEYS if k in g} for g in raw_optimizer(opt).param_groups]


def restore_impl_choice(state: dict[str, Any], choice: list[dict[str, Any]] | None) -> None:
    """Put the user's ``fused`` / ``foreach`` back into an optimizer ``state_dict()``:
    a checkpoint must not say ``fused=True`` because RoundPipe switched it on (plain
    Lightning would then resume it fused)."""
    groups = state.get("param_groups")
    if choice is None or not isinstance(groups, list) or len(groups) != len(choice):
        return
    for group, own in zip(groups, choice):
        for key in IMPL_KEYS:
            if key in own:
                group[key] = own[key]
            else:
                group.pop(key, None)


def fuse_optimizer(opt: Optimizer) -> bool:
    """Switch ``opt`` in place to torch's fused CPU kernel when it has one and the user
    left ``fused`` unset (:func:`roundpipe_core.optim.use_fastest_`); the object stays the
    same, so LR schedulers built on it keep working.

    The update is the same arithmetic (within fp32 rounding) and, on the host, several
    times faster than the per-tensor loop torch picks for CPU tensors by default. When it
    cannot switch, it logs why once per optimizer class and reason.

    Returns:
        Whether ``opt`` now runs fused.
    """
    if any(g.get("fused") for g in opt.param_groups):
        return True
    # fused=False is a choice too (use_fastest_ only leaves fused=True / foreach= alone)
    explicit = any(g.get("fused") is False for g in opt.param_groups)
    if not explicit and use_fastest_(opt):
        return True
    reason = _not_fused_reason(opt)
    key = (type(opt).__qualname__, reason)
    if key not in _SAID:
        _SAID.add(key)
        log.info("RoundPipeStrategy runs %s unfused: %s", type(opt).__name__, reason)
    return False


def host_memory_budget(
    rp: RoundPipe, optimizers: list[Optimizer], num_microbatch: int | None
) -> HostMemoryBudget:
    """The host memory ``rp`` trained by ``optimizers`` needs. An optimizer whose state
    size is unknown (a third-party class) does not stop training: the budget assumes
    Adam's two states per parameter and says so once."""
    try:
        return estimate_host_memory(rp, optimizer=optimizers, num_microbatch=num_microbatch)
    except UnknownOptimizerError as exc:
        names = ", ".join(sorted({type(o).__name__ for o in optimizers}))
        if ("budget", names) not in _SAID:
            _SAID.add(("budget", names))
            rank_zero_warn(
                f"RoundPipe cannot tell how much state {names} keeps ({exc}); the host-memory "
                f"budget assumes {ASSUMED_OPTIMIZER_STATES} parameter-sized tensors per parameter"
            )
        return estimate_host_memory(
            rp, optimizer_states=ASSUMED_OPTIMIZER_STATES, num_microbatch=num_microbatch
        )


def check_loss_went_through(loss: Tensor, rp: RoundPipe) -> None:
    """Refuse a loss whose graph reaches the wrapped network's own parameters: the
    network ran outside RoundPipe, its gradients would never reach the masters the
    optimizer steps, and training would silently do nothing."""
    names = {id(p): name for name, p in rp.model.named_parameters()}
    reached = reaches_params(loss, set(names)) if loss.requires_grad else None
    if reached is not None:
        raise RuntimeError(
            f"the loss's autograd graph reaches the parameter {names[reached]!r} of the network "
            "configure_sequential() returned, whose gradients never reach the master copies "
            "the optimizer steps. Either the network was called directly (e.g. self.net(x) or "
            "self.model(**batch).loss): call it through self.roundpipe instead -- "
            "loss = self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=...) or "
            "out = self.roundpipe(x) -- or a term of the loss uses its weights (an L2 penalty "
            "over self.parameters()): use the optimizer's weight_decay, or add the penalty's "
            "gradient to the optimizer's parameters (the masters) in on_before_optimizer_step"
        )
