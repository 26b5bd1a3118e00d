"""Checks of a model and a call before RoundPipe runs them.

:func:`check_forward_rules` watches a layer's forward once (the engine: each layer's
first, :class:`ForwardRuleChecker`) and warns about each write the forward rules forbid
(docs/presets.md#forward-rules: layers run at once on per-device copies, so a forward
writes only its own buffers); writes to globals cannot be seen. The other checks refuse
before a call what the engine could not honour, or warn (:meth:`IdleSteps.watch`) when
steps keep updating no master.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from . import batch as batching
from .kinds import check_byte_counts
from .planning.profile import check_plan_fits, measure_activation_bytes, scale_activation_bytes
from .running.carried import REPLICA_OWNED
from .stepping.masters import MasterWeights

__all__ = [
    "ForwardRuleChecker",
    "PlanFitChecker",
    "check_forward_rules",
    "check_not_compiled_in_place",
    "find_shared_buffers",
]

# Keys every nn.Module has in its __dict__: the engine and PyTorch manage them.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training"}
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _fingerprint(value: Any, depth: int = 0) -> Any:
    """A cheap value that changes when ``value`` is rebound or (shallowly) mutated."""
    if isinstance(value, _IMMUTABLE):
        return ("v", value)
    if isinstance(value, torch.Tensor):
        return ("t", id(value), value._version)
    if isinstance(value, nn.Module):
        return ("m", id(value))  # submodules are checked on their own
    if isinstance(value, tuple) and depth < 2:
        return ("tuple", tuple(_fingerprint(v, depth + 1) for v in value))
    if isinstance(value, (list, dict, set, frozenset)) and depth < 2:
        if isinstance(value, dict):
            items = tuple((repr(k), _fingerprint(v, depth + 1)) for k, v in value.items())
        else:
            items = tuple(sorted((_fingerprint(v, depth + 1) for v in value), key=repr))
        return ("c", id(value), type(value).__name__, items)
    if callable(value) or isinstance(value, type):
        return ("o", id(value))
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and depth < 1:
        # plain objects held by the layer (a config, say): one level of their attributes
        return ("obj", id(value), tuple((k, _fingerprint(v, depth + 1)) for k, v in attrs.items()))
    return ("o", id(value))


def _plain_attributes(module: nn.Module) -> dict[tuple[str, str], Any]:
    snap: dict[tuple[str, str], Any] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        # attributes an upload rebuilds for this replica alone (a quantized layer's quant
        # state): its forward may write them, no other layer or device sees them
        owned = vars(mod).get(REPLICA_OWNED, ())
        for key, value in vars(mod).items():
            if key in _MODULE_INTERNALS or key in owned or key == REPLICA_OWNED:
                continue
            snap[(mod_name, key)] = _fingerprint(value)
    return snap


def find_shared_buffers(layers: Sequence[nn.Module]) -> list[set[str]]:
    """For each layer, the names of its buffers that another layer also holds (same tensor)."""
    owners: dict[int, set[int]] = {}
    named: list[list[tuple[str, torch.Tensor]]] = []
    for i, layer in enumerate(layers):
        bufs = list(layer.named_buffers(remove_duplicate=False))
        named.append(bufs)
        for _, b in bufs:
            owners.setdefault(id(b), set()).add(i)
    return [{name for name, b in bufs if len(owners[id(b)]) > 1} for bufs in named]


def check_forward_rules(
    layer_index: int,
    module: nn.Module,
    run: Callable[[], Any],
    shared_buffers: Collection[str] = (),
    error: bool = False,
) -> Any:
    """Run ``run()`` (the forward of ``module``) and warn about each forward-rule
    violation, naming layer ``layer_index``; returns what ``run()`` returned.
    ``shared_buffers``: buffers other layers share (:func:`find_shared_buffers`).

    Raises:
        ValueError: with ``error=True`` (instead of a warning), on the first violation.
    """
    attrs_before = _plain_attributes(module)
    params = [(n, p, p._version) for n, p in module.named_parameters(remove_duplicate=True)]
    shared_set = set(shared_buffers)
    buffers = {
        n: (b, b._version)
        for n, b in module.named_buffers(remove_duplicate=False)
        if n in shared_set
    }
    out = run()
    problems: list[str] = []
    attrs_after = _plain_attributes(module)
    for key in sorted(set(attrs_before) | set(attrs_after)):
        before, after = attrs_before.get(key), attrs_after.get(key)
        if before == after:
            continue
        what = "added" if before is None else ("deleted" if after is None else "written")
        problems.append(f"plain attribute '{'.'.join(k for k in key if k)}' {what}")
    for name, p, version in params:
        if p._version != version:
            problems.append(f"parameter '{name}' written in place (parameters are read-only)")
    now = dict(module.named_buffers(remove_duplicate=False))
    for name, (b, version) in buffers.items():
        if now.get(name) is not b:
            problems.append(f"shared buffer '{name}' rebound")
        elif b._version != version:
            problems.append(f"shared buffer '{name}' written in place")
    for problem in problems:
        msg = (
            f"RoundPipe forward rule violated in layer {layer_index} ({type(module).__name__}): "
            f"{problem} during forward. Layers run concurrently on different devices: a forward "
            "may only write buffers that belong to this layer alone (register_buffer); keep "
            "other state out of forward"
        )
        if error:
            raise ValueError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return out


class ForwardRuleChecker:
    """Check each layer of a model once, on its first forward (thread-safe):
    ``checker.run(i, replica, lambda: replica(x))``."""

    def __init__(self, layers: Sequence[nn.Module], watch_host_rng: bool = False) -> None:
        self.shared = find_shared_buffers(layers)
        self.watch_host_rng = watch_host_rng
        self._done: set[int] = set()
        self._lock = threading.Lock()

    def run(self, layer_index: int, module: nn.Module, run: Callable[[], Any]) -> Any:
        """``run()``, watched the first time ``layer_index`` runs; with ``watch_host_rng``
        (GPUs: recompute does not replay CPU draws) also for host random draws."""
        with self._lock:
            first = layer_index not in self._done
            self._done.add(layer_index)
        if not first:
            return run()
        shared = self.shared[layer_index] if layer_index < len(self.shared) else set()
        before = torch.default_generator.get_state() if self.watch_host_rng else None
        out = check_forward_rules(layer_index, module, run, shared)
        if before is not None and not torch.equal(before, torch.default_generator.get_state()):
            # (or another thread drew meanwhile: reported the same way)
            warnings.warn(
                f"layer {layer_index} ({type(module).__name__}) drew from the CPU random "
                "generator in its forward on a GPU worker; RoundPipe's recompute replays only "
                "the GPU's generator, so its backward sees other random numbers than its "
                "forward. Draw on the layer's device (torch.rand(..., device=x.device)), or "
                "use save_for_recompute() to keep what the forward drew",
                RuntimeWarning,
                stacklevel=2,
            )
        return out


def check_not_compiled_in_place(layers: Sequence[nn.Module]) -> None:
    """Refuse (ValueError, naming the first such module and the fix) layers compiled in
    place (``module.compile()``): the device copies would silently run uncompiled
    (``torch.compile(module)`` copies with its compilation)."""
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if getattr(module, "_compiled_call_impl", None) is not None:
                where = f"layer {i}" + (f" (submodule {name!r})" if name else "")
                raise ValueError(
                    f"{where} was compiled in place with .compile(), which RoundPipe's "
                    "per-device copies cannot keep; compile it as a new module instead "
                    "(layers[i] = torch.compile(layer)) before wrapping"
                )


def check_not_on_meta(model: nn.Module) -> None:
    """Refuse (ValueError) a model with parameters or buffers on the meta device (no
    data), which would fail only at the first call, on a worker thread."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.device.type == "meta":
                raise ValueError(
                    f"{kind} {name!r} is on the meta device (it has no data): materialize the "
                    "model before wrapping it, e.g. model.to_empty(device='cpu') and then load "
                    "its weights (load_state_dict), or build it outside torch.device('meta')"
                )


def check_no_post_accumulate_hooks(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse (ValueError) parameters with a ``register_post_accumulate_grad_hook`` hook:
    devices backpropagate into copies, so autograd never calls it (``register_hook`` works)."""
    for name, p in named:
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise ValueError(
                f"parameter {name!r} has a gradient hook (register_post_accumulate_grad_hook), "
                "which RoundPipe cannot honour: devices backpropagate into copies of the "
                "parameters and the gradients are added to master copies on the host. Remove "
                "the hook (handle.remove()); to act on a complete gradient use "
                "p.register_hook(fn) (run on each call's whole gradient), "
                "RoundPipe.register_grad_hook(fn) (gets the masters once their gradients are "
                "in) or RoundPipe.step_layerwise() to step parameters as they complete"
            )


def check_inputs_need_no_grad(args: Any, kwargs: dict[str, Any]) -> None:
    """Refuse (ValueError) ``forward_backward`` inputs that require grad: it backpropagates
    into the RoundPipe's parameters only, so such an input would silently get no ``.grad``."""
    for where, value in [("input_args", args), ("input_kwargs", kwargs)]:
        leaves, _ = batching.tree.flatten(value)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                raise ValueError(
                    f"forward_backward: tensor {i} of {where} (shape {tuple(leaf.shape)}) "
                    "requires grad, but forward_backward computes the gradients of the "
                    "RoundPipe's parameters only: it would get no .grad. Pass it detached "
                    "(x.detach()) if it needs none, or compute loss = loss_fn(rp(x), y) and "
                    "call loss.backward(), which backpropagates into the inputs too"
                )


# model parameter id -> (the parameter, the RoundPipe making its master), both weak: one
# open RoundPipe per parameter (two would step two copies, one update lost)
_PARAM_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_PARAM_OWNERS_LOCK = threading.Lock()


def claim_parameters(model: nn.Module, owner: Any) -> None:
    """Record ``owner`` (a RoundPipe) as the one keeping masters of ``model``'s trainable
    parameters (``None``: only check); raise if another open RoundPipe already does."""
    mine = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with _PARAM_OWNERS_LOCK:
        for name, p in mine:
            entry = _PARAM_OWNERS.get(id(p))
            if entry is None:
                continue
            param, other = entry[0](), entry[1]()
            if param is not p or other is None or other._steps.closed:
                del _PARAM_OWNERS[id(p)]  # a dead or closed owner (or a reused id)
                continue
            raise ValueError(
                f"parameter {name!r} is already trained by RoundPipe {other.name!r}, which "
                "keeps its own master copy of it: two RoundPipes would each step their copy "
                "and one update would be lost. close() the other RoundPipe first, wrap a "
                "copy of the model (copy.deepcopy), or give the second one "
                "master_owner=<the first> to accumulate into the first one's masters"
            )
        if owner is None:
            return
        ref = weakref.ref(owner)
        for _, p in mine:
            _PARAM_OWNERS[id(p)] = (weakref.ref(p), ref)


class IdleSteps:
    """Counts consecutive steps that updated no master although gradients were there;
    warns after :attr:`LIMIT` (a loss scaler may skip a few on purpose)."""

    LIMIT = 3

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self.warned = False
        self.settled = False  # a step updated a master: nothing left to watch

    def observe(self, updated: bool) -> None:
        self.settled |= updated
        self.count = 0 if updated else self.count + 1
        if self.count >= self.LIMIT and not self.warned:
            self.warned = True
            warnings.warn(
                f"RoundPipe {self.name!r}: {self.count} steps in a row updated none of the "
                "master copies although they had gradients -- is the optimizer built over "
                "rp.parameters() (the model's weights, which get no gradients)? Build it over "
                "rp.optim_parameters(), or inside `with OptimizerCtx():`",
                RuntimeWarning,
                stacklevel=1,
            )

    def watch(self, fn: Callable[[], Any], masters: MasterWeights) -> Callable[[], Any]:
        """``fn`` that also observes whether it changed a master that had a gradient (by
        version counters, else by each first element: fused kernels bump no counter)."""

        def watched() -> Any:
            if self.settled or self.warned:
                return fn()
            with torch.no_grad():
                before = [
                    (m, m._version, m.detach().reshape(-1)[:1].clone())
                    for m in masters.params()
                    if m.grad is not None and m.numel()
                ]
            result = fn()
            if before:
                updated = any(m._version != v for m, v, _ in before)
                if not updated:
                    with torch.no_grad():
                        updated = any(
                            not torch.equal(m.detach().reshape(-1)[:1], first)
                            for m, _, first in before
                        )
                self.observe(updated)
            return result

        return watched


class PlanFitChecker:
    """Refuses a manual plan whose stages cannot fit the smallest device, once per plan.
    ``activation_bytes`` (measured once on two rows of the first training call, scaled
    up) is what the automatic planner counts too."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.activation_bytes: list[float] | None = None
        self._measured = False
        self._checked: set[tuple] = set()

    def set_activation_bytes(self, value: Sequence[float] | None) -> None:
        """Give the bytes instead of measuring them (``None``: measure again); ValueError
        unless one non-negative number per layer."""
        if value is not None:
            value = check_byte_counts(value, "layer_activation_bytes", len(self.layers))
        self.activation_bytes = value
        self._measured = value is not None
        self._checked.clear()

    def measure(self, args: tuple, kwargs: dict, rows: int) -> None:
        """Saved-activation bytes of a microbatch of ``rows`` rows, measured once on two
        (a layer that cannot run on the host leaves them unknown, with a warning)."""
        if self._measured:
            return
        self._measured = True
        # two rows: a training BatchNorm refuses a single value per channel
        sample = min(rows, 2)
        if rows > sample:
            (args, kwargs), _ = batching.split_tree((args, kwargs), [sample, rows - sample], rows)
        # leave no trace: the random stream and the buffers (BatchNorm statistics)
        saved = [(b, b.detach().clone()) for layer in self.layers for b in layer.buffers()]
        try:
            with torch.random.fork_rng(devices=[]):
                measured = measure_activation_bytes(
                    self.layers, *args, with_loss_transient=True, **kwargs
                )
            self.activation_bytes = (
                scale_activation_bytes(measured, sample, rows)
                if rows > sample
                else [float(b) for b in measured]
            )
        except Exception as exc:  # the measurement is advisory: the call itself may still run
            warnings.warn(
                f"could not measure activation memory on the host ({type(exc).__name__}: {exc}); "
                "plans are checked against parameters and gradients only",
                RuntimeWarning,
                stacklevel=3,
            )
        finally:
            with torch.no_grad():
                for b, copy in saved:
                    b.copy_(copy)

    def check(
        self,
        plan: Any,
        run_type: Any,
        profile: Callable[[], Any],
        capacity_bytes: Callable[[], float],
    ) -> None:
        """``check_plan_fits`` for ``plan`` unless it already passed for this run type
        (``profile()`` and ``capacity_bytes()`` are asked only then: they cost)."""
        key = (
            str(run_type),
            tuple((r.start, r.stop) for r in plan.fwd_plan),
            tuple((r.start, r.stop) for r in plan.bwd_plan),
            self.activation_bytes is not None,
        )
        if key in self._checked:
            return
        check_plan_fits(plan, profile(), run_type, capacity_bytes())
        self._checked.add(key)
