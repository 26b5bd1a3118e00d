"""Tensors a layer keeps outside its parameters and buffers, carried with each upload.

bitsandbytes is the common case: a 4-bit ``Linear4bit`` keeps its packed weight in a
``Params4bit`` (a ``Parameter`` subclass with attributes) whose ``quant_state`` (absmax,
code book, maybe a nested state) is a plain object shared with the module's own
attribute; an 8-bit ``Linear8bitLt`` keeps scales in ``Int8Params.SCB`` and a
``MatmulLtState``. Other layers keep a plain tensor attribute (``self.mask``).

A replica needs all of it on its device, fresh on every upload: bitsandbytes' forward
rewrites that state (on CPU an eval forward repacks the weight), so a state kept
across uploads would describe the previous upload's tensors. So it is described once
per skeleton (:class:`CarriedState`) and rebuilt on every upload from device copies,
each host object once, so what the host shares stays shared; the host objects are
never written. The rebuilt attributes belong to the replica alone, so a forward may
write them: the replica lists them under :data:`REPLICA_OWNED` for the rule checker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "REPLICA_FLAGS",
    "REPLICA_OWNED",
    "CarriedState",
    "UntrainableStateError",
    "attribute_tensors",
    "carried_bytes",
    "carried_tensors",
    "logical_numel",
]

#: Name of the replica-module attribute listing its attributes rebuilt on each upload.
REPLICA_OWNED = "_roundpipe_replica_owned"

# how deep plain objects are followed (module attribute -> quant state -> nested state)
_MAX_DEPTH = 3
_STATIC = ("static",)
_MISSING = object()
# nn.Module's own tables and flags: never carried
_MODULE_KEYS = frozenset(nn.Module().__dict__) | {"training", REPLICA_OWNED}
# Flags a replica runs with whatever the host module says. bitsandbytes' Linear4bit, on
# CPU in eval mode, computes a forward whose input needs no grad with a repacked
# weight (repacked on every upload) and a bf16 kernel, and any other forward from the
# weight as it is. A training call's forward stages run without grad and are
# recomputed with grad: with that path on, the recompute would not compute what the
# forward did (its gradients off by about 0.5 %). Replicas take the one path, and so
# does a converter's probe of the host model (the repack would stay in its weights).
REPLICA_FLAGS = {"support_avx512bf16_for_cpu": False}
# Packages whose layers keep per-layer state objects that their forward writes even
# when no tensor is in them yet (Linear8bitLt's MatmulLtState takes the weight's CB and
# SCB on every forward): each replica gets its own copy, made on every upload.
_PER_REPLICA_PACKAGES = ("bitsandbytes.",)


class UntrainableStateError(ValueError):
    """A layer holds, outside its parameters and buffers, a tensor that requires grad (a
    forward storing its results on its module): its copy could not be trained."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def _is_subclass_param(t: torch.Tensor) -> bool:
    """A parameter of a subclass with attributes (Params4bit): its replica is one too."""
    return isinstance(t, nn.Parameter) and type(t) is not nn.Parameter and bool(vars(t))


class _Describer:
    """Walks a layer once and records how to rebuild what holds tensors."""

    def __init__(self, sources: Sequence[torch.Tensor], replicas: dict[int, nn.Module]) -> None:
        self.position = {id(t): i for i, t in enumerate(sources)}
        self.sources = list(sources)
        self.replicas = replicas  # id(host module) -> replica module
        self.extras: list[torch.Tensor] = []
        self.extra_pos: dict[int, int] = {}
        self.nodes: dict[int, Any] = {}  # id(host object) -> its recipe (once per object)
        self.visited: dict[int, torch.Tensor] = {}  # every tensor met outside the sources
        # (host __dict__, key, value) of every attribute that holds tensors: the recipes
        # stay valid while each is still bound to the same value
        self.bindings: list[tuple[dict[str, Any], str, Any]] = []

    def _alias(self, t: torch.Tensor) -> Any:
        """A recipe for ``t`` as a view of a source's device copy, if it is one."""
        if t.is_meta:  # no address: a meta tensor (a model being budgeted) aliases nothing
            return None
        ptr = t.untyped_storage().data_ptr()
        for i, src in enumerate(self.sources):
            if (
                src.dtype == t.dtype
                and src.device == t.device
                and src.is_contiguous()
                and src.untyped_storage().data_ptr() == ptr
                and t.numel() > 0
            ):
                offset = t.storage_offset() - src.storage_offset()
                last = offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
                if offset >= 0 and last < src.numel():
                    return ("alias", i, tuple(t.shape), tuple(t.stride()), offset)
        return None

    def tensor(self, t: torch.Tensor, where: str) -> Any:
        if id(t) in self.position:
            return ("source", self.position[id(t)])
        self.visited[id(t)] = t
        alias = self._alias(t)
        if alias is not None:
            return alias
        if t.requires_grad:
            raise UntrainableStateError(
                f"{where} is a tensor that requires grad but is neither a parameter nor a "
                "buffer: RoundPipe uploads it with the layer but cannot train it. Register it "
                "with nn.Parameter (to train it) or register_buffer / .detach() (to keep it fixed)",
                where,
            )
        if id(t) not in self.extra_pos:
            self.extra_pos[id(t)] = len(self.extras)
            self.extras.append(t)
        return ("extra", self.extra_pos[id(t)])

    def value(self, v: Any, where: str, depth: int) -> Any:
        """The recipe of ``v``: ``_STATIC`` (kept as is) unless it holds tensors."""
        if isinstance(v, torch.Tensor):
            return self.tensor(v, where)
        if isinstance(v, nn.Module):
            rep = self.replicas.get(id(v))
            return _STATIC if rep is None else ("module", rep)
        if depth >= _MAX_DEPTH or isinstance(v, (type, str, bytes, int, float, bool)):
            return _STATIC
        if type(v) is tuple:  # immutable: a copy with device tensors means the same
            items = [self.value(x, f"{where}[{k}]", depth + 1) for k, x in enumerate(v)]
            if all(r is _STATIC for r in items):
                return _STATIC
            return ("seq", v, tuple(items))
        # Mutable containers and other objects are the user's: a layer may share them on
        # purpose (a log, a cache), so replicas keep reading and writing the host's, as
        # before (the forward rules warn about writes). Only the state objects of the
        # per-replica packages (bitsandbytes' QuantState, MatmulLtState) are copied.
        attrs = getattr(v, "__dict__", None)
        if (
            not isinstance(attrs, dict)
            or callable(v)
            or not type(v).__module__.startswith(_PER_REPLICA_PACKAGES)
        ):
            return _STATIC
        key = id(v)
        if key in self.nodes:
            return self.nodes[key]
        node: list[Any] = ["object", v, ()]
        self.nodes[key] = node  # before the walk: a cycle back to ``v`` finds it
        node[2] = self.attributes(attrs, where, depth + 1)
        return node

    def attributes(self, attrs: dict[str, Any], where: str, depth: int) -> tuple:
        """``(key, recipe)`` of each attribute in ``attrs`` that holds tensors."""
        out = []
        for k, x in list(attrs.items()):
            r = self.value(x, f"{where}.{k}", depth)
            if r is not _STATIC:
                out.append((k, r))
                self.bindings.append((attrs, k, x))
        return tuple(out)

    def param(self, p: torch.Tensor, where: str) -> Any:
        """The recipe of a subclass parameter: its class around the device copy, with its
        attributes (those holding tensors rebuilt)."""
        return (type(p), p, self.attributes(vars(p), where, 1))


class _Build:
    """One upload's rebuild: device copies in, replica objects out (each host object once)."""

    __slots__ = ("dev", "extras", "made")

    def __init__(self, dev: Sequence[torch.Tensor], extras: Sequence[torch.Tensor]) -> None:
        self.dev = dev
        self.extras = extras
        self.made: dict[int, Any] = {}

    def value(self, r: Any) -> Any:
        kind = r[0]
        if kind == "source":
            return self.dev[r[1]]
        if kind == "extra":
            return self.extras[r[1]]
        if kind == "alias":
            _, i, shape, stride, offset = r
            return self.dev[i].detach().as_strided(shape, stride, offset)
        if kind == "module":
            return r[1]
        if kind == "seq":
            _, host, items = r
            return tuple(h if i is _STATIC else self.value(i) for h, i in zip(host, items))
        # a plain object holding tensors: a copy of it per upload
        key = id(r)
        made = self.made.get(key)
        if made is None:
            _, host, dynamic = r
            host_cls: Any = type(host)
            made = host_cls.__new__(host_cls)  # no __init__: its attributes come from the host's
            self.made[key] = made
            made.__dict__.update(host.__dict__)  # the host's flags as they are now
            for k, i in dynamic:
                made.__dict__[k] = self.value(i)
        return made


class CarriedState:
    """How one layer's carried state is uploaded, built once per skeleton from the host
    layer, its replica and the parameter/buffer ``sources`` (upload order): ``tensors``
    to upload besides them; per upload :meth:`wrap_params`, :meth:`attach`, and
    :meth:`detach` at release (``ValueError`` naming a plain attribute that requires
    grad)."""

    def __init__(
        self,
        layer: nn.Module,
        replica: nn.Module,
        sources: Sequence[torch.Tensor],
        name: str = "layer",
    ) -> None:
        pairs = list(zip(layer.named_modules(remove_duplicate=False), replica.modules()))
        describer = _Describer(sources, {id(m): r for (_, m), r in pairs})
        self.params: list[tuple[int, Any]] = [
            (i, describer.param(src, f"{name}: parameter {i} ({type(src).__name__})"))
            for i, src in enumerate(sources)
            if _is_subclass_param(src)
        ]
        self.param_pos = frozenset(i for i, _ in self.params)
        self.attrs: list[tuple[nn.Module, str, Any]] = []
        self.flags: list[tuple[nn.Module, str, Any]] = []
        self.owned: dict[int, tuple[nn.Module, set[str]]] = {}
        seen: set[int] = set()
        for (mod_name, m), rep in pairs:
            if id(m) in seen:
                continue
            seen.add(id(m))
            for k, v in list(vars(m).items()):
                if k in _MODULE_KEYS:
                    continue
                what = f"module {mod_name or '(root)'!r} ({type(m).__name__}) attribute {k!r}"
                r = describer.value(v, f"{name}: {what}", 0)
                if r is not _STATIC:
                    self.attrs.append((rep, k, r))
                    self.owned.setdefault(id(rep), (rep, set()))[1].add(k)
                    describer.bindings.append((vars(m), k, v))
                elif k in REPLICA_FLAGS and "quant_state" in vars(m):
                    self.flags.append((rep, k, REPLICA_FLAGS[k]))
        self.tensors: list[torch.Tensor] = describer.extras
        self.visited = describer.visited  # every tensor met outside the sources
        self._bindings = describer.bindings

    def current(self) -> bool:
        """Whether every host attribute it rebuilds is still bound to what it described
        (a re-quantized layer, or a rebound tensor attribute, needs a new description)."""
        return all(d.get(k, _MISSING) is v for d, k, v in self._bindings)

    @property
    def empty(self) -> bool:
        """Nothing to carry: the layer's parameters and buffers are all there is."""
        return not self.params and not self.attrs and not self.flags

    def mark_replica(self) -> None:
        """List each replica module's carried attributes under :data:`REPLICA_OWNED`."""
        for rep, keys in self.owned.values():
            rep.__dict__[REPLICA_OWNED] = frozenset(keys)

    def wrap_params(
        self,
        dev: Sequence[torch.Tensor],
        extras: Sequence[torch.Tensor],
        held: list[Any],
        requires_grad: Sequence[bool | None],
    ) -> _Build:
        """Set ``held[i]`` of each subclass parameter to its class around ``dev[i]``; the
        returned build rebuilds the rest of this upload's carried state."""
        build = _Build(dev, extras)
        for i, (cls, host, dynamic) in self.params:
            p = torch.Tensor._make_subclass(cls, dev[i], bool(requires_grad[i]))
            p.__dict__.update(host.__dict__)
            for k, r in dynamic:
                p.__dict__[k] = build.value(r)
            held[i] = p
        return build

    def attach(self, build: _Build) -> None:
        """Set the replica modules' carried attributes for this upload."""
        for rep, k, r in self.attrs:
            rep.__dict__[k] = build.value(r)
        for rep, k, value in self.flags:  # after the sync of the host's flags
            rep.__dict__[k] = value

    def detach(self) -> None:
        """Drop this upload's carried attributes (the device memory goes with them)."""
        for rep, k, _ in self.attrs:
            rep.__dict__[k] = None


def _walk(layer: nn.Module, name: str = "layer") -> CarriedState:
    """The layer's carried state described against itself (no replica)."""
    sources = list({id(t): t for t in [*layer.parameters(), *layer.buffers()]}.values())
    return CarriedState(layer, layer, sources, name)


def attribute_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """Every tensor ``layer`` holds outside its parameters and buffers (a skeleton must
    not deep-copy them)."""
    return list(_walk(layer).visited.values())


def carried_tensors(layer: nn.Module, name: str = "layer") -> list[torch.Tensor]:
    """The host tensors an upload of ``layer`` carries besides its parameters and buffers,
    each once (``ValueError`` as :class:`CarriedState`, ``name`` starting the message)."""
    return _walk(layer, name).tensors


def carried_bytes(layer: nn.Module) -> int:
    """Bytes of :func:`carried_tensors` (distinct storages)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in carried_tensors(layer)
    }
    return sum(storages.values())


def logical_numel(p: torch.Tensor) -> int:
    """The weights ``p`` stands for: a packed 4-bit parameter's quant state's shape, else
    its ``numel()``."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    if isinstance(shape, (tuple, list)) and all(isinstance(n, int) for n in shape):
        return math.prod(shape)
    return p.numel()
