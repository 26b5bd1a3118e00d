"""Experimental automatic split of an arbitrary model (``use_sequential_preset=False``).

:func:`auto_wrap` turns a *chain* (an ``nn.Sequential``, or a module whose ``forward``,
traced with ``torch.fx``, feeds one input through its children in turn) into a plain
:class:`RoundPipe` over the chain's steps, and any other model into an
:class:`AutoRoundPipe`: submodules within the threshold (or chains) become *units*, each
run by an inner RoundPipe on the shared pool, and the glue code of the opened modules
runs on the host. Where the split cannot see the code it is never silently wrong: what a
unit call cannot honour is refused, naming the unit and the fix. See docs/presets.md,
"Automatic split".
"""

from __future__ import annotations

import inspect
import logging
import re
from collections import Counter
from collections.abc import Callable, Collection, Mapping, MutableMapping, MutableSequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate, map_arg
from torch.overrides import TorchFunctionMode

from .base import RoundPipeBase
from .batch.explain import leaf_paths
from .batch.tree import Replicate, batch_size_of, flatten, split_sizes
from .config import RoundPipeRunConfig, check_run_config
from .kinds import PinMode, check_int
from .model import RoundPipe
from .running.carried import UntrainableStateError

__all__ = ["AutoRoundPipe", "auto_wrap", "chain_layers", "split_layers"]


# ---------------------------------------------------------------- split rules


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def nbytes(module: nn.Module, recurse: bool = True) -> int:
    """Bytes of the parameters and buffers (shared tensors once): the published
    RoundPipe's measure of a module's size for its thresholds."""
    tensors = [*module.parameters(recurse), *module.buffers(recurse)]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def has_own_forward(m: nn.Module) -> bool:
    """Whether ``m`` has a forward of its own (a ModuleList, ModuleDict has not: its
    children are called by the parent's code, so it cannot run as one unit)."""
    return type(m).forward is not nn.Module.forward


# ``self.<child>.<attribute>`` in a forward's source, unless only its metadata is read
_CHILD_ATTRIBUTE = re.compile(
    r"self\.(\w+)\.(\w+)\b(?!\s*\.\s*(?:dtype|device|shape|ndim|requires_grad)\b)(?!\s+is\b)"
)


def reads_child_weights(m: nn.Module) -> bool:
    """Whether ``m``'s own ``forward`` source uses a child's parameter directly
    (``F.conv1d(x, self.conv1d.weight)`` in Mamba's mixers): such a module is one unit, not
    opened. Uses the scan cannot see are found while the model runs (:class:`HostReads`)."""
    try:
        source = inspect.getsource(type(m).forward)
    except (OSError, TypeError):  # no source (built in, generated): nothing to read
        return False
    for child_name, attr in _CHILD_ATTRIBUTE.findall(source):
        child = m._modules.get(child_name)
        if child is not None and attr in child._parameters:
            return True
    return False


class SplitRules:
    """How the tree is cut into units, from auto_wrap's arguments (each checked): the size
    measure and its thresholds, the modules kept on the host, and the modules that take
    their own run config."""

    def __init__(
        self,
        model: nn.Module,
        split_threshold: int | None,
        upper_threshold: int | None,
        lower_threshold: int | None,
        skip_modules: Collection[nn.Module],
        override_config: Mapping[nn.Module, RoundPipeRunConfig] | None,
    ) -> None:
        check_split_arguments(
            split_threshold, upper_threshold, lower_threshold, skip_modules, override_config
        )
        for m in override_config or {}:
            if not has_own_forward(m):
                raise ValueError(
                    f"override_config names a {type(m).__name__}, which has no forward of its "
                    "own and cannot run as one unit; name its children instead"
                )
        inside = {id(x) for x in model.modules()}
        for what, mods in (
            ("skip_modules", list(skip_modules)),
            ("override_config", list(override_config or {})),
        ):
            for m in mods:
                if id(m) not in inside:
                    raise ValueError(
                        f"{what} holds a {type(m).__name__} that is not a submodule of the model"
                    )
        self.threshold = max(1, numel(model) // 8) if split_threshold is None else split_threshold
        self.size: Callable[[nn.Module], int] = numel
        if upper_threshold is not None:  # bytes, as the published RoundPipe
            self.threshold, self.size = upper_threshold, nbytes
        self.lower = lower_threshold
        self.skip = {id(m) for m in skip_modules}
        self.override = {id(m): c for m, c in (override_config or {}).items()}

    def whole(self, m: nn.Module) -> bool:
        """``m`` (holding no skipped module) becomes one unit without being opened."""
        if id(m) in self.override:
            return True
        # a module that holds big parameters itself cannot be cut below them
        own = nbytes(m, recurse=False)
        return self.lower is not None and own > 0 and own >= self.lower

    def config_of(
        self, m: nn.Module, default: RoundPipeRunConfig | None
    ) -> RoundPipeRunConfig | None:
        """The run config of unit ``m``: its override, else ``default``; a unit smaller than
        ``lower_threshold`` runs as one microbatch (too small to pipeline)."""
        if id(m) in self.override:
            return self.override[id(m)]
        if self.lower is not None and nbytes(m) < self.lower:
            base = default if default is not None else RoundPipeRunConfig()
            return replace(base, num_microbatch=1)
        return default


def _check_bytes(name: str, value: Any, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes or None, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} bytes, got {value}")


def check_split_arguments(
    split_threshold: Any,
    upper_threshold: Any,
    lower_threshold: Any,
    skip_modules: Any,
    override_config: Any,
) -> None:
    """The automatic split's arguments, each checked on its own (``auto_wrap``,
    ``AutoRoundPipe`` and ``wrap_model_to_roundpipe`` take the same ones); what needs
    the model (submodules, forwards of their own) :class:`SplitRules` checks."""
    if split_threshold is not None:
        check_int(split_threshold, "split_threshold", why="parameters")
    _check_bytes("upper_threshold", upper_threshold, 1)
    _check_bytes("lower_threshold", lower_threshold, 0)
    if split_threshold is not None and upper_threshold is not None:
        raise ValueError(
            "give upper_threshold (bytes, as the published RoundPipe) or split_threshold "
            "(parameters), not both"
        )
    if (
        isinstance(skip_modules, (nn.Module, str, bytes))
        or not isinstance(skip_modules, Collection)
        or not all(isinstance(m, nn.Module) for m in skip_modules)
    ):
        raise TypeError(
            f"skip_modules must be a collection of nn.Module (e.g. [model.lm_head]), got "
            f"{skip_modules!r}"
        )
    if override_config is not None and not isinstance(override_config, Mapping):
        raise TypeError(
            "override_config must be a dict {submodule: RoundPipeRunConfig}, got "
            f"{type(override_config).__name__}"
        )
    for m, cfg in (override_config or {}).items():
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"override_config keys must be submodules of the model, got {type(m).__name__}"
            )
        check_run_config(cfg, f"override_config[{type(m).__name__}]")


# ---------------------------------------------------------------- unit calls

#: Hugging Face loss types whose loss is a mean over label tokens != -100, and whether the
#: labels are shifted by one first (transformers.loss.loss_utils.LOSS_MAPPING)
_TOKEN_MEAN_LOSSES = {"ForCausalLM": True, "ForConditionalGeneration": True, "ForMaskedLM": False}
_IGNORE_INDEX = -100


def _input_leaves(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of every leaf of a unit call's inputs (as the batch split sees them)."""
    return [
        pair
        for where, value in (("args", args), ("kwargs", kwargs))
        for pair in zip(leaf_paths(value, where), flatten(value)[0])
    ]


def why_not_cut(args: tuple, kwargs: dict, batch: int | None) -> str | None:
    """Why a unit call cannot be cut along the AutoRoundPipe call's ``batch``: there is
    none, or an input tensor's dim 0 is neither it nor 1 (a broadcast dim); else ``None``."""
    if batch is None:
        return "the AutoRoundPipe call has no batch dim to cut along"
    for path, leaf in _input_leaves(args, kwargs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] not in (batch, 1):
            shape = tuple(leaf.shape)
            return f"its input {path} of shape {shape} has a dim 0 that is not the batch ({batch})"
    return None


#: ``split_input`` of a call that must not be cut: every input whole, in one microbatch
#: (also where the engine would otherwise sample two rows to measure activations)
WHOLE_CALL = (Replicate, Replicate)


def token_count_kwargs(unit: nn.Module, kwargs: dict, num_microbatch: int) -> dict | None:
    """``kwargs`` with ``num_items_in_batch`` set so that the microbatches' Hugging Face
    losses average to the whole batch's loss, or ``None`` if ``unit`` computes no such loss.

    With ``num_items_in_batch=N`` a token-mean loss is the microbatch's token sum over
    ``N``; ``N`` is the whole call's label tokens != -100 (after the shift, for a causal
    LM) or the caller's own count, and each microbatch gets ``N / num_microbatch`` because
    the merge averages 0-dim outputs: the average is then Hugging Face's loss.
    """
    labels = kwargs.get("labels")
    # Hugging Face's own loss only (not a loss_function of the user's); as
    # PreTrainedModel.loss_function, a model without a loss_type (GPT-2) is a causal LM
    if not hasattr(type(unit), "loss_function") or "_loss_function" in vars(unit):
        return None
    shifted = _TOKEN_MEAN_LOSSES.get(getattr(unit, "loss_type", None) or "ForCausalLM")
    if not isinstance(labels, torch.Tensor) or shifted is None:
        return None
    params = inspect.signature(type(unit).forward).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD or p.name == "num_items_in_batch" for p in params):
        return None
    count = kwargs.get("num_items_in_batch")
    if count is None:
        counted = kwargs.get("shift_labels")
        if not isinstance(counted, torch.Tensor):
            counted = labels[..., 1:] if shifted else labels
        count = (counted != _IGNORE_INDEX).sum()
    return {**kwargs, "num_items_in_batch": count / num_microbatch}


def mutable_state(
    args: tuple, kwargs: dict, unit_name: str, unit: nn.Module, model: nn.Module
) -> list[tuple[str, Any, tuple]]:
    """``(where, object, contents by identity)`` of the mutable input containers the batch
    split does not open (transformers' ``KVSharingDict``, any ``MutableMapping`` or
    ``MutableSequence``): where a unit could leave state for later units. A transformers
    ``Cache`` input (XLM builds one even in training) is refused."""
    state = []
    for path, leaf in _input_leaves(args, kwargs):
        if any(
            c.__name__ == "Cache" and c.__module__.startswith("transformers")
            for c in type(leaf).__mro__
        ):
            raise ValueError(
                f"automatic split: unit {unit_name or '<root>'!r} ({type(unit).__name__}) takes "
                f"a transformers {type(leaf).__name__} as its input {path}: a decoding cache it "
                "writes into for later units, outside the call's inputs and outputs, which "
                "separate units on the device pool cannot share. Load the model with "
                "use_cache=False if it honours that, or make the module that passes the cache "
                f"one unit: override_config={{{spelled(caller_of(model, unit_name))}: "
                "RoundPipeRunConfig()} in wrap_model_to_roundpipe / auto_wrap"
            )
        if isinstance(leaf, (MutableMapping, MutableSequence)):
            state.append((path, leaf, _contents(leaf)))
    return state


def _contents(obj: Any) -> tuple:
    if isinstance(obj, MutableMapping):
        return tuple((k, id(v)) for k, v in obj.items())
    return tuple(id(v) for v in obj)


def check_no_state_written(
    state: list[tuple[str, Any, tuple]], unit_name: str, unit: nn.Module, model: nn.Module
) -> None:
    """Refuse a unit call that wrote into a mutable input of :func:`mutable_state`."""
    for where, obj, before in state:
        if _contents(obj) != before:
            parent = caller_of(model, unit_name)
            raise ValueError(
                f"automatic split: unit {unit_name or '<root>'!r} ({type(unit).__name__}) wrote "
                f"into its input {where}, a {type(obj).__name__}: state passed on to later units "
                "outside the call's inputs and outputs (as Gemma 3n's shared key/value states). "
                "Across separate units it would hold one microbatch's values and lose its "
                "gradient. Make the module that passes it on one unit: "
                f"override_config={{{spelled(parent)}: RoundPipeRunConfig()}} (or a module above "
                "it) in wrap_model_to_roundpipe / auto_wrap"
            )


def caller_of(model: nn.Module, name: str) -> str:
    """The nearest module above ``name`` with a forward of its own (a ModuleList's parent):
    the one whose code calls it, which ``override_config`` can make one unit."""
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        if has_own_forward(model.get_submodule(name)):
            return name
    return name


def spelled(name: str) -> str:
    """How a user names the submodule ``name`` of ``model`` in Python."""
    if not name:
        return "model"
    if all(part.isidentifier() for part in name.split(".")):
        return f"model.{name}"
    return f"model.get_submodule({name!r})"


def check_no_batch_reduction(
    out: Any, loss_normalised: bool, unit_name: str, unit: nn.Module, num_microbatch: int
) -> None:
    """Refuse a 0-dim floating output of a call cut into microbatches (but the first leaf
    where :func:`token_count_kwargs` normalised the loss): the merge averages it."""
    for i, leaf in enumerate(flatten(out)[0]):
        if not (isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and leaf.is_floating_point()):
            continue
        if loss_normalised and i == 0:
            continue
        raise ValueError(
            f"automatic split: unit {unit_name or '<root>'!r} ({type(unit).__name__}) returned "
            f"a 0-dim tensor (output leaf {i}) computed on each of its {num_microbatch} "
            "microbatches; their average is not the whole batch's value (a mean over tokens, a "
            "sum, an auxiliary loss differ). Run that module as one microbatch: "
            f"override_config={{{spelled(unit_name)}: RoundPipeRunConfig(num_microbatch=1)}} "
            "in wrap_model_to_roundpipe / auto_wrap"
        )


class HostReads(TorchFunctionMode):
    """Watches the host code of one ``AutoRoundPipe.forward`` (this thread only; units run
    on worker threads) for unit parameters used outside their unit's call
    (``F.conv1d(x, self.conv1d.weight)`` in a parent's forward): their gradient lands in
    the model tensor's ``.grad``, so they are collected from the host too."""

    def __init__(self, unit_params: Mapping[int, nn.Parameter]) -> None:
        super().__init__()
        self.unit_params = unit_params
        self.found: dict[int, nn.Parameter] = {}
        self.paused = 0  # > 0 inside a unit's own call

    def _note(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) in self.unit_params:
                self.found[id(value)] = self.unit_params[id(value)]
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._note(v)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # only a use a gradient flows back through (not .dtype, .shape, .detach() ...)
        if not self.paused and isinstance(out, torch.Tensor) and out.requires_grad:
            self._note(args)
            self._note(tuple(kwargs.values()))
        return out


_log = logging.getLogger(__name__)


# ---------------------------------------------------------------- chain detection


class _Prev:
    """Marks where the previous step's output goes in a step's arguments (a class, so that
    deep copies of the step keep it identical)."""


def _templates(node: Any) -> tuple[tuple, dict]:
    # _Prev (a class) stands in for the node: not an fx Argument, hence the ignores
    return (
        map_arg(node.args, lambda n: _Prev),  # type: ignore[arg-type,return-value]
        map_arg(dict(node.kwargs), lambda n: _Prev),  # type: ignore[arg-type,return-value]
    )


class TracedOp(nn.Module):
    """One operation of a traced chain that is not a plain ``child(x)`` call: ``target`` (a
    function, a method of the input, a child) with the traced arguments, the previous
    operation's output where the trace had it."""

    def __init__(
        self, kind: str, target: Any, args: tuple, kwargs: dict, module: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.kind = kind
        self.target = target
        self.args = args
        self.kwargs = kwargs
        self.module = module

    def forward(self, x: Any) -> Any:
        args = map_aggregate(self.args, lambda a: x if a is _Prev else a)
        kwargs = map_aggregate(self.kwargs, lambda a: x if a is _Prev else a)
        if self.kind == "call_module":
            assert self.module is not None
            return self.module(*args, **kwargs)
        if self.kind == "call_method":
            return getattr(args[0], self.target)(*args[1:], **kwargs)
        return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        name = (
            self.target
            if isinstance(self.target, str)
            else getattr(self.target, "__name__", repr(self.target))
        )
        return f"{self.kind}: {name}"


def chain_layers(module: nn.Module) -> list[nn.Module] | None:
    """The steps of ``module`` if its forward is a chain (one input; each step's output,
    and nothing else, goes to the next; steps are children called once each or
    functions/methods of the running value), else ``None``."""
    if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
        layers = list(module.children())
        return layers if layers and len({id(m) for m in layers}) == len(module) else None
    if type(module).forward is nn.Module.forward or isinstance(
        module, (nn.ModuleList, nn.ModuleDict)
    ):
        return None
    if not any(True for _ in module.children()):
        return None
    try:

        class _ChildrenAsLeaves(fx.Tracer):
            def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
                return "." not in qualname

        graph = _ChildrenAsLeaves().trace(module)
    except Exception:  # noqa: BLE001 - anything fx cannot trace is not a chain we can prove
        return None
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1 or nodes[0] is not placeholders[0]:
        return None
    prev = placeholders[0]
    steps: list[nn.Module] = []
    used: set[int] = set()
    for node in nodes[1:]:
        if len(prev.users) != 1:
            return None
        if node.op == "output":
            return steps if node.args[0] is prev and steps else None
        if node.op not in ("call_module", "call_function", "call_method"):
            return None  # get_attr: the forward uses a parameter/buffer of the module itself
        if node.all_input_nodes != [prev]:
            return None
        if node.op == "call_module":
            child = module.get_submodule(node.target)
            if id(child) in used:
                return None  # a child called twice cannot be two Sequential layers
            used.add(id(child))
            if node.args == (prev,) and not node.kwargs:
                steps.append(child)
            else:
                steps.append(TracedOp("call_module", node.target, *_templates(node), module=child))
        else:
            steps.append(TracedOp(node.op, node.target, *_templates(node)))
        prev = node
    return None


def split_layers(
    module: nn.Module, split_threshold: int, size: Callable[[nn.Module], int] = numel
) -> list[nn.Module]:
    """``module`` as a list of Sequential layers: chains are opened, and steps larger than
    ``split_threshold`` (by ``size``: parameter elements unless given) that are chains are
    opened recursively."""
    steps = chain_layers(module)
    if steps is None:
        return [module]
    out: list[nn.Module] = []
    for step in steps:
        if size(step) > split_threshold and chain_layers(step) is not None:
            out.extend(split_layers(step, split_threshold, size))
        else:
            out.append(step)
    return out


# --------------------------------------------------------------------------- AutoRoundPipe


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _plan_units(
    model: nn.Module, rules: SplitRules
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Parameter]]]:
    """Units (qualified name, module) and host parameters (owned directly by opened
    modules, or by skipped ones). A module reached twice is one unit, listed once."""
    units: list[tuple[str, nn.Module]] = []
    host: list[tuple[str, nn.Parameter]] = []
    seen_modules: set[int] = set()
    seen_host: set[int] = set()

    def keep_on_host(qualname: str, p: nn.Parameter) -> None:
        if id(p) not in seen_host:
            seen_host.add(id(p))
            host.append((qualname, p))

    def visit(name: str, m: nn.Module) -> None:
        if id(m) in seen_modules:
            return
        seen_modules.add(id(m))
        if id(m) in rules.skip:
            for pname, p in m.named_parameters():
                keep_on_host(_join(name, pname), p)
            return
        if numel(m) == 0:
            return  # no parameters: it runs on the host as glue
        if has_own_forward(m) and not any(id(x) in rules.skip for x in m.modules()):
            has_param_children = any(numel(c) for c in m.children())
            if (
                rules.whole(m)
                or rules.size(m) <= rules.threshold
                or not has_param_children
                or chain_layers(m) is not None
                # not the root: one unit for the whole model would pipeline nothing
                or (name and reads_child_weights(m))
            ):
                units.append((name, m))
                return
        for pname, p in m.named_parameters(recurse=False):
            keep_on_host(_join(name, pname), p)
        for cname, child in m.named_children():
            visit(_join(name, cname), child)

    visit("", model)
    return units, host


class _Direct(nn.Module):
    """Runs a unit's own ``forward`` (the class's), bypassing the redirect installed on the
    host module while an AutoRoundPipe forward runs."""

    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.unit).forward(self.unit, *args, **kwargs)


def _make_redirect(auto: AutoRoundPipe, index: int, batch: int | None) -> Callable[..., Any]:
    # A plain function (not functools.partial): the engine deep-copies layers into device
    # replicas, and deepcopy keeps functions as they are instead of copying ``auto``.
    def forward(*args: Any, **kwargs: Any) -> Any:
        return auto._call_unit(index, batch, args, kwargs)

    return forward


class AutoRoundPipe(RoundPipeBase):
    """A model that could not become one Sequential, run unit by unit on the device pool
    (see the module docstring). Masters, ``step`` / ``synchronize``, ``OptimizerCtx`` and
    the attribute fall-through are :class:`RoundPipeBase`'s; ``forward`` runs the original
    ``forward`` on the host with each unit's calls sent to its inner RoundPipe.

    Attributes:
        units: ``(qualified name, inner RoundPipe)`` per unit.
        host_parameters: ``(qualified name, parameter)`` of parameters used by
            host glue code: those opened modules own, and (added as ``forward`` finds
            them) unit parameters the host code uses outside their unit.
    """

    def __init__(
        self,
        model: nn.Module,
        split_threshold: int | None = None,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        pin_model: PinMode | str = PinMode.ALLOC,
        devices: Any = None,
        original_model: Any = None,
        upper_threshold: int | None = None,
        lower_threshold: int | None = None,
        skip_modules: Collection[nn.Module] = (),
        override_config: Mapping[nn.Module, RoundPipeRunConfig] | None = None,
        shared_masters: bool | None = None,
    ) -> None:
        if model_run_config is not None:
            check_run_config(model_run_config, "model_run_config")
        rules = SplitRules(
            model, split_threshold, upper_threshold, lower_threshold, skip_modules, override_config
        )
        super().__init__(
            model,
            optim_dtype=optim_dtype,
            name=name,
            pin_model=pin_model,
            devices=devices,
            original_model=original_model,
            shared_masters=shared_masters,  # None: shared on CPU workers, as RoundPipe's
        )
        self.model_run_config = model_run_config or RoundPipeRunConfig()
        unit_modules, host = _plan_units(model, rules)
        units: list[tuple[str, RoundPipe]] = []
        for uname, unit in unit_modules:
            layers = split_layers(unit, rules.threshold, rules.size)
            seq = nn.Sequential(*layers) if len(layers) > 1 else nn.Sequential(_Direct(unit))
            # The outer RoundPipe owns the master copies; the inner one sends its gradients there.
            inner = RoundPipe(
                seq,
                optim_dtype=optim_dtype,
                name=f"{self.name}.{uname or 'root'}",
                model_run_config=rules.config_of(unit, model_run_config),
                pin_model="off",
                devices=self.pool,
                original_model=unit,
                master_owner=self,
            )
            units.append((uname, inner))
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "host_parameters", host)
        object.__setattr__(self, "_unit_modules", [m for _, m in unit_modules])
        object.__setattr__(self, "_unsplit_units", set())  # units told to run unsplit
        # every parameter of a unit that is not a host parameter: (name, unit name) by id
        on_host = {id(p) for _, p in host}
        unit_params: dict[int, tuple[str, str, nn.Parameter]] = {}
        for uname, unit in unit_modules:
            for pname, p in unit.named_parameters(prefix=uname):
                if id(p) not in on_host and p.requires_grad:
                    unit_params.setdefault(id(p), (pname, uname, p))
        object.__setattr__(self, "_unit_params", unit_params)
        object.__setattr__(self, "_host_reads", None)  # the watch of the forward running
        self._seal()
        _log.info("AutoRoundPipe %r: %s", self.name, self.summary())

    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """Run the original model's forward on the host, its units on the device pool."""
        if roundpipe_run_config is not None:
            raise TypeError(
                "AutoRoundPipe.forward does not take roundpipe_run_config (each unit runs with "
                "the model_run_config given at wrapping time)"
            )
        self._check_open()
        # no wait for a step in flight: like RoundPipe.forward, this computes with the weights
        # the model holds (one step stale after step(is_async=True)); gradients of its
        # backward wait for the step before they land (RoundPipeBase._fold_grads)
        with self._call_lock:
            # the batch every unit's microbatches are cut from (None: no batch to cut)
            batch = batch_size_of((args, kwargs))
            for i, unit in enumerate(self._unit_modules):
                object.__setattr__(unit, "forward", _make_redirect(self, i, batch))
            watch = HostReads({i: p for i, (_, _, p) in self._unit_params.items()})
            object.__setattr__(self, "_host_reads", watch)
            try:
                with watch:
                    return self.model(*args, **kwargs)
            finally:
                object.__setattr__(self, "_host_reads", None)
                for unit in self._unit_modules:
                    object.__delattr__(unit, "forward")
                self._collect_host_reads(watch.found)

    def _collect_host_reads(self, found: Mapping[int, nn.Parameter]) -> None:
        """Take the unit parameters the host code used as host parameters too, and say
        so once, with what would keep them in one unit."""
        for key in found:
            pname, uname, p = self._unit_params.pop(key)
            self.host_parameters.append((pname, p))
            parent = caller_of(self.model, uname)
            _log.warning(
                "AutoRoundPipe %r: the host code (the forward of %s, or a module around it) "
                "uses %r, a parameter of unit %r, outside that unit's forward (e.g. "
                "F.conv1d(x, self.conv1d.weight)); its gradient is taken from the host too. "
                "The module reading it runs its own code on the host; to run it on the "
                "devices as one unit pass override_config={%s: RoundPipeRunConfig()}",
                self.name,
                type(self.model.get_submodule(parent)).__name__,
                pname,
                uname,
                spelled(parent),
            )

    def _call_unit(self, index: int, batch: int | None, args: tuple, kwargs: dict) -> Any:
        """One call of unit ``index`` from the host code, on its inner RoundPipe: cut into
        microbatches only where that gives the numbers of one whole call."""
        name, inner = self.units[index]
        unit = self._unit_modules[index]
        cfg = RoundPipeRunConfig(requires_grad=torch.is_grad_enabled())
        n = len(split_sizes(batch_size_of((args, kwargs)), inner.num_microbatch_for()))
        if n > 1:
            odd = why_not_cut(args, kwargs, batch)
            if odd is not None:
                # cutting along a dim 0 that is not the batch would misalign the pieces
                # (Bloom's ALiBi: batch x heads; MoE experts: experts x tokens)
                if name not in self._unsplit_units:
                    self._unsplit_units.add(name)
                    _log.info(
                        "AutoRoundPipe %r: unit %r (%s) runs as one microbatch: %s",
                        self.name,
                        name or "<root>",
                        type(unit).__name__,
                        odd,
                    )
                cfg = replace(cfg, num_microbatch=1, split_input=WHOLE_CALL)
                n = 1
        state = mutable_state(args, kwargs, name, unit, self.model)
        normalised = token_count_kwargs(unit, kwargs, n) if n > 1 else None
        watch = self._host_reads
        if watch is not None:
            watch.paused += 1  # the unit's own call reads its parameters legitimately
        try:
            out = inner(*args, roundpipe_run_config=cfg, **(normalised or kwargs))
        except UntrainableStateError as exc:
            # the model's own code, not the caller's: say which unit and what keeps it working
            where = exc.where.replace("layer: module 'unit.", f"module '{name}.")
            raise ValueError(
                f"automatic split: unit {name or '<root>'!r} ({type(unit).__name__}) stores "
                f"state on its own modules that the device pool cannot carry ({where} "
                "requires grad but is not a parameter or buffer: its forward keeps a result "
                "on the module, such as a recurrent or decoding state). Keep that module on "
                f"the host, where it runs as plain PyTorch and its parameters are still "
                f"trained: skip_modules=[{spelled(name)}] (and each such module) in "
                "wrap_model_to_roundpipe / auto_wrap"
            ) from exc
        finally:
            if watch is not None:
                watch.paused -= 1
        check_no_state_written(state, name, unit, self.model)
        if n > 1:
            check_no_batch_reduction(out, normalised is not None, name, unit, n)
        return out

    def forward_backward(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: the model is not one Sequential, so there is no last stage to fuse.

        Raises:
            TypeError: always, saying what to do instead.
        """
        raise TypeError(
            "forward_backward() is not supported by AutoRoundPipe: the automatic split could not "
            f"turn {type(self.model).__name__} into an nn.Sequential, so forward and loss cannot be "
            "fused into the last stage. Use `loss = loss_fn(model(*inputs), label); loss.backward()` "
            "instead, or convert the model to an nn.Sequential (or add a preset) for full speed"
        )

    def _take_model_grads(self) -> None:
        """Before a step: host parameters' ``.grad`` moves to their masters."""
        for _, p in self.host_parameters:
            if p.grad is not None and self.masters.master_of.get(id(p)) is not p:
                self.masters.add_grad(p, p.grad)
                p.grad = None

    def close(self) -> None:
        """Stop the inner RoundPipes, then this one (and the shared pool)."""
        try:
            for _, inner in self.units:
                inner.close()
        finally:
            super().close()

    def summary(self) -> str:
        """What the split made, in one line (units, pipelined ones, host parameters)."""
        pipelined = sum(1 for _, inner in self.units if inner.num_layers > 1)
        counts = Counter(id(p) for unit in self._unit_modules for p in unit.parameters())
        shared = sum(1 for c in counts.values() if c > 1)
        return (
            f"{len(self.units)} units run on the device pool ({pipelined} of them pipelined "
            f"over several layers), {len(self.host_parameters)} parameters on the host"
            + (f", {shared} of its parameters in several units (tied)" if shared else "")
        )

    def unit_of(self, param: torch.Tensor) -> str | None:
        """The name of the (first) unit holding ``param`` (``""``: the root), else ``None``."""
        for (uname, _), unit in zip(self.units, self._unit_modules):
            if any(p is param for p in unit.parameters()):
                return uname
        return None

    def __repr__(self) -> str:
        names = ", ".join(n or "<root>" for n, _ in self.units)
        return f"AutoRoundPipe(name={self.name!r}, units=[{names}], devices={self.pool!r})"


def auto_wrap(
    model: nn.Module,
    split_threshold: int | None = None,
    model_run_config: RoundPipeRunConfig | None = None,
    optim_dtype: torch.dtype | None = None,
    upper_threshold: int | None = None,
    lower_threshold: int | None = None,
    skip_modules: Collection[nn.Module] = (),
    override_config: Mapping[nn.Module, RoundPipeRunConfig] | None = None,
    **roundpipe_kwargs: Any,
) -> RoundPipe | AutoRoundPipe:
    """Automatic split: a RoundPipe over a Sequential when the model is a chain, else an AutoRoundPipe.

    Args:
        model: any module.
        split_threshold: modules with more parameters (elements) than this are split
            further; default 1/8 of the model's parameters.
        model_run_config: default run config (of the RoundPipe, or of every unit).
        optim_dtype: dtype of the master weights.
        upper_threshold: instead of ``split_threshold``, in bytes of parameters and
            buffers (the published RoundPipe's unit): modules larger than this are split.
        lower_threshold: bytes: a module whose own (direct) parameters and buffers reach
            this becomes one unit without being opened, and a unit smaller than this runs
            as one microbatch. ``None``: no such rule.
        skip_modules: submodules left as plain modules on the host (their parameters
            still get master copies and are trained).
        override_config: ``{submodule: RoundPipeRunConfig}``: that submodule becomes one
            unit run with that config.
        **roundpipe_kwargs: ``pin_model``, ``devices``, ``name``.

    Raises:
        TypeError / ValueError: a threshold, skipped module or override is malformed or
            names a module outside ``model``.
    """
    rules = SplitRules(
        model, split_threshold, upper_threshold, lower_threshold, skip_modules, override_config
    )
    # a skipped or separately configured inner module needs the unit-by-unit form
    inner_rules = any(id(m) != id(model) for m in list(skip_modules) + list(override_config or {}))
    layers = [model] if inner_rules else split_layers(model, rules.threshold, rules.size)
    if len(layers) > 1:
        return RoundPipe(
            nn.Sequential(*layers),
            optim_dtype=optim_dtype,
            model_run_config=rules.override.get(id(model), model_run_config),
            original_model=model,
            **roundpipe_kwargs,
        )
    return AutoRoundPipe(
        model,
        split_threshold=split_threshold,
        optim_dtype=optim_dtype,
        model_run_config=model_run_config,
        upper_threshold=upper_threshold,
        lower_threshold=lower_threshold,
        skip_modules=skip_modules,
        override_config=override_config,
        **roundpipe_kwargs,
    )
