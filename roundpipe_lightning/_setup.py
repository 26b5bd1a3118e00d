"""Conversions of RoundPipeStrategy's set-up: what ``configure_sequential()`` returns, and
the optimizers it points at the masters. The argument checks live in ``_arguments`` (and
are re-exported here)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from roundpipe_core import AutoRoundPipe, RoundPipe, RoundPipeRunConfig
from roundpipe_core import distributed as D
from roundpipe_core.autosplit import auto_wrap
from roundpipe_core.optim import fastest_impl, use_fastest_
from roundpipe_core.running.host_memory import (
    HostMemoryBudget,
    UnknownOptimizerError,
    estimate_host_memory,
)

from ._arguments import (
    check_bool,
    check_choice,
    check_num_microbatch,
    check_plugins,
    check_pool_devices,
    check_type,
    parse_dtype,
)
from ._private import defer_zero_grad, restore_zero_grad
from .plans import resolve_execute_plan

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
    "point_at_masters",
    "build_roundpipe",
    "network_of",
    "wrap_network",
    "zero_grad_after_step",
    "order_manual_zero_grad",
    "release_optimizers",
    "fuse_optimizer",
    "user_impl_choice",
    "restore_impl_choice",
    "host_memory_budget",
    "setup_summary",
    "op_name",
    "reaches_params",
    "check_loss_went_through",
    "check_shardable",
    "check_step_request",
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


def sequential_of(lm: pl.LightningModule) -> tuple[nn.Module, Any]:
    """Call ``configure_sequential()`` and check what it returned.

    Returns:
        ``(network, original)``: the module RoundPipe wraps -- an ``nn.Sequential``, a
        preset's conversion, or any other module, which :func:`wrap_network` splits
        automatically -- and, when a preset converted a Hugging Face model, that model
        (else None).
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
    return network_of(net, "configure_sequential() returned")


def network_of(net: nn.Module, source: str) -> tuple[nn.Module, Any]:
    """``(network, original)`` of a module a strategy wraps: an ``nn.Sequential`` as it
    is, a Hugging Face model a preset converts with that model as ``original``, any other
    module as it is (:func:`wrap_network` splits it automatically). ``source`` starts the
    error message ("configure_sequential() returned", "fabric.setup() got")."""
    if isinstance(net, nn.Sequential):
        if len(net) == 0:
            raise ValueError(f"{source} an empty nn.Sequential; give it layers")
        return net, None
    from roundpipe_core.presets import convert_if_possible

    # a preset, else the converter by structure (it logs why it refuses a model)
    seq = convert_if_possible(net)
    if seq is not None:
        return seq, net
    return net, None  # any other module: the automatic split (wrap_network)


def wrap_network(
    net: nn.Module,
    original: Any,
    loss_reduction: str,
    shared_masters: bool,
    execute_plan: Any = None,
    source: str = "configure_sequential() returned",
    owner: str = "RoundPipeStrategy",
    loss_hint: str = "compute the loss from self.roundpipe(...) (e.g. "
    "self.roundpipe(input_ids=x, labels=x).loss), Lightning backpropagates it",
    **common: Any,
) -> RoundPipe | AutoRoundPipe:
    """The RoundPipe of ``configure_sequential()``'s network (``common``: ``optim_dtype``,
    ``name``, ``model_run_config``, ``pin_model``, ``devices``). ``source``, ``owner`` and
    ``loss_hint`` word the messages for the strategy that asks.

    An ``nn.Sequential`` (a preset's conversion included) is wrapped as it is. Any other
    module gets the automatic split, as ``wrap_model_to_roundpipe(use_sequential_preset=False)``
    does, and the run says so once: a chain of children becomes a ``RoundPipe`` over them;
    anything else (skip connections, several inputs) an ``AutoRoundPipe``, whose units run
    on the pool and whose glue code runs on the host.
    """
    if isinstance(net, nn.Sequential):
        return RoundPipe(
            net,
            original_model=original,
            loss_reduction=loss_reduction,
            shared_masters=shared_masters,
            **common,
        )
    rp = auto_wrap(net, **common)
    kind = type(net).__name__
    said = (
        f"{source} a {kind}: not an nn.Sequential, and neither a preset nor the converter "
        "by structure converts it (the log of roundpipe_core.presets says why), so RoundPipe splits it automatically (as wrap_model_to_roundpipe("
        "use_sequential_preset=False) does): "
    )
    if not isinstance(rp, RoundPipe) and execute_plan is not None:
        rp.close()
        raise ValueError(
            f"{owner}(execute_plan=...) plans an nn.Sequential; the {kind} ({source} it) "
            "is split automatically into units (AutoRoundPipe), which have no such plan. Drop "
            "execute_plan, or give an nn.Sequential."
        )
    if isinstance(rp, RoundPipe):
        rp.loss_reduction = loss_reduction
        rank_zero_info(said + f"a chain of {rp.num_layers} layers, pipelined as a Sequential.")
        return rp
    rank_zero_warn(
        said
        + f"AutoRoundPipe: {rp.summary()}; the code between the units runs on the host. It is slower than a Sequential and has no forward_backward: {loss_hint}. "
        "For full speed give an nn.Sequential of its layers, or "
        f"register a preset: roundpipe_core.presets.register_preset({kind!r}, "
        "lambda model: nn.Sequential(...)) (docs/add-a-preset.md)."
    )
    return rp


def build_roundpipe(
    net: nn.Module,
    original: Any,
    *,
    name: str,
    devices: list[torch.device],
    model_run_config: RoundPipeRunConfig | None,
    num_microbatch: int | None,
    recompute_grain: str | None,
    preserve_rng_state: bool,
    optim_dtype: torch.dtype | None,
    pin_model: str,
    async_step: bool,
    execute_plan: Any,
    loss_reduction: str,
    **wording: str,
) -> RoundPipe | AutoRoundPipe:
    """The RoundPipe a strategy trains: ``net`` (see :func:`wrap_network`; ``wording``: its
    ``source`` / ``owner`` / ``loss_hint``) on a pool of ``devices`` (CPU workers or GPUs),
    with the strategy's run-config defaults and its ``execute_plan`` set for
    ``forward_backward``.

    A synchronous step may update the weights in place, so with ``async_step=False`` the
    parameters already in ``optim_dtype`` are their own masters (no separate fp32 copy).
    """
    cfg = model_run_config or RoundPipeRunConfig()
    if num_microbatch is not None:
        cfg = replace(cfg, num_microbatch=num_microbatch)
    if recompute_grain is not None:
        cfg = replace(cfg, recompute_grain=recompute_grain)
    cfg = replace(cfg, preserve_rng_state=preserve_rng_state)
    pool_arg: Any = f"cpu:{len(devices)}" if devices[0].type == "cpu" else devices
    rp = wrap_network(
        net,
        original,
        loss_reduction,
        shared_masters=not async_step,
        execute_plan=execute_plan,
        optim_dtype=optim_dtype,
        name=name,
        model_run_config=cfg,
        pin_model=pin_model,
        devices=pool_arg,
        **wording,
    )
    if isinstance(rp, RoundPipe):  # (an AutoRoundPipe has no fused call to plan)
        try:
            plan = resolve_execute_plan(execute_plan, rp, "fused")
            if plan is not None:
                rp.set_plan("fused", plan)
        except BaseException:
            rp.close()
            raise
    return rp


def adopt_optimizer(
    opt: Optimizer, rp: RoundPipe | AutoRoundPipe, real_zero_grad: dict[int, Callable[..., None]]
) -> None:
    """Point ``opt`` at ``rp``'s master copies (:func:`point_at_masters`) and defer its
    ``zero_grad`` to the RoundPipe step (its own ``zero_grad`` is kept in
    ``real_zero_grad[id(opt)]``).

    Lightning zeroes the gradients *after* ``training_step`` in automatic optimization,
    which would wipe what ``forward_backward`` just produced; the queued step clears them
    right after the update instead.
    """
    point_at_masters(opt, rp)
    if id(opt) not in real_zero_grad:
        real_zero_grad[id(opt)] = defer_zero_grad(opt)


def point_at_masters(
    opt: Optimizer, rp: RoundPipe | AutoRoundPipe, build_hint: str = "self.parameters()"
) -> None:
    """Replace the model parameters in ``opt``'s param groups by their master copies
    (a frozen parameter stays; a shared master is the parameter itself). LBFGS is
    refused: its ``step()`` re-evaluates the loss, which a queued step cannot."""
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
            f"RoundPipe will not train it. Build it from {build_hint}."
        )


def zero_grad_after_step(
    rp: RoundPipe | AutoRoundPipe, real: Callable[..., None]
) -> Callable[..., None]:
    """An optimizer's ``zero_grad`` that clears the gradients in order with ``rp``'s
    queued step (``RoundPipe.after_step``): after it has read them, never under it."""

    def zero_grad(set_to_none: bool = True) -> None:
        rp.after_step(functools.partial(real, set_to_none=set_to_none))

    return zero_grad


def order_manual_zero_grad(
    lm: pl.LightningModule,
    rp: RoundPipe | AutoRoundPipe,
    real_zero_grad: dict[int, Callable[..., None]],
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
        rank_zero_info(f"RoundPipeStrategy runs {type(opt).__name__} unfused: {reason}")
    return False


def setup_summary(
    owner: str,
    rp: RoundPipe | AutoRoundPipe,
    num_microbatch: int | None,
    async_step: bool,
    step_chosen: bool,
) -> str:
    """The one line a run's set-up says beside Lightning's own: the device pool, the plan
    of ``forward_backward`` and its microbatches, and the step mode (``step_chosen``:
    ``async_step`` was passed, else the hardware chose it)."""
    workers = rp.pool.workers
    n = len(workers)
    if rp.pool.is_cuda:
        pool = f"{n} GPU{'s' if n != 1 else ''} ({', '.join(str(w.device) for w in workers)})"
    else:
        pool = f"{n} CPU worker{'s' if n != 1 else ''}"
    if isinstance(rp, RoundPipe):
        m = rp.num_microbatch_for(num_microbatch)
        layout = rp.plan_for("fused").to_layout_string()
        plan = f'plan "{layout}", {m} microbatch{"es" if m != 1 else ""}'
    else:
        plan = f"{len(rp.units)} units split automatically"
    step = "asynchronous (one step stale)" if async_step else "synchronous"
    if not step_chosen:
        step += " (async_step=None follows the hardware; pass True or False to choose)"
    return f"{owner}: {pool}, {rp.num_layers} layers, {plan}; step {step}"


def host_memory_budget(
    rp: RoundPipe | AutoRoundPipe,
    optimizers: list[Optimizer],
    num_microbatch: int | None,
    dp: D.DataParallel | None = None,
    async_step: bool | None = None,
) -> HostMemoryBudget:
    """The host memory ``rp`` trained by ``optimizers`` needs (``dp``: the data-parallel
    wrapper, whose sharding divides the state and adds its collectives' buffers;
    ``async_step``: whether the step overlaps the next iteration, whose gradients then
    arrive beside the step's). An optimizer whose state size is unknown (a third-party
    class) does not stop training: the budget assumes Adam's two states per parameter
    and says so once."""
    state_shards = 1 if dp is None else dp.state_shards
    buffers = 0 if dp is None else dp.kept_buffer_bytes(rp, optimizers)
    try:
        return estimate_host_memory(
            rp,
            optimizer=optimizers,
            num_microbatch=num_microbatch,
            state_shards=state_shards,
            async_step=async_step,
            collective_buffers=buffers,
        )
    except UnknownOptimizerError as exc:
        names = ", ".join(sorted({type(o).__name__ for o in optimizers}))
        if ("budget", names) not in _SAID:
            _SAID.add(("budget", names))
            rank_zero_warn(
                f"RoundPipe cannot tell how much state {names} keeps ({exc}); the host-memory "
                f"budget assumes {ASSUMED_OPTIMIZER_STATES} parameter-sized tensors per parameter"
            )
        return estimate_host_memory(
            rp,
            optimizer_states=ASSUMED_OPTIMIZER_STATES,
            num_microbatch=num_microbatch,
            state_shards=state_shards,
            async_step=async_step,
            collective_buffers=buffers,
        )


def check_shardable(shard_host_state: bool, loss_scaler: object | None) -> None:
    """Refuse ``shard_host_state=True`` with a loss scaler (``16-mixed``): each process
    sees only its share of the gradients, so their overflow checks would disagree."""
    if shard_host_state and loss_scaler is not None:
        raise ValueError(
            "RoundPipeStrategy(shard_host_state=True) does not support precision='16-mixed': each "
            "process sees only its share of the gradients, so the loss scaler's overflow check "
            "would differ between processes. Use precision='bf16-mixed' or 'bf16-true' (no loss "
            "scaling), or shard_host_state=False."
        )


def check_step_request(async_step: Any, owner: str) -> bool | None:
    """A strategy's ``async_step`` as requested (``None``: follow the hardware), sharded
    host state or not: an asynchronous step shards the masters too (each process's
    share's updates reach the others' models when the step's weights are published,
    ``DataParallel.attach(..., async_step=True)``)."""
    if async_step is None:
        return None
    return check_bool("async_step", async_step, owner)


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


def check_loss_went_through(
    loss: Tensor, rp: RoundPipe | AutoRoundPipe, message: str = _DIRECT_CALL
) -> None:
    """Refuse a loss whose graph reaches the wrapped network's own parameters: the
    network ran outside RoundPipe, its gradients would never reach the masters the
    optimizer steps, and training would silently do nothing. ``message`` says what to
    call instead (the Lightning strategy's by default; ``{param}`` is the parameter the
    loss reaches)."""
    names = {id(p): name for name, p in rp.model.named_parameters()}
    if isinstance(rp, AutoRoundPipe):  # its glue code uses these on the host, legitimately
        for _, p in rp.host_parameters:
            names.pop(id(p), None)
    reached = reaches_params(loss, set(names)) if loss.requires_grad else None
    if reached is not None:
        text = message.replace("{param!r}", repr(names[reached]))
        unit = (
            rp.unit_of(_param_by_id(rp.model, reached)) if isinstance(rp, AutoRoundPipe) else None
        )
        if unit is not None:
            # the model's own code cannot be the cause: AutoRoundPipe.forward finds the host
            # code's uses of a unit's parameter and trains them (autosplit._HostReads)
            text += (
                f". (It is a parameter of the automatic split's unit {unit or '<root>'!r}; uses of "
                "it by the model's own code inside self.roundpipe(...) are found and trained, so "
                "this graph was built outside that call.)"
            )
        raise RuntimeError(text)


def _param_by_id(model: nn.Module, key: int) -> torch.Tensor:
    return next(p for p in model.parameters() if id(p) == key)
