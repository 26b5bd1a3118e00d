"""What the planner knows about a model's layers (:class:`LayerProfile`): times, sizes
and activation memory, and the memory a plan's stages need (:class:`StageMemory`,
:func:`check_plan_fits`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..kinds import JobKind, RunType, parse_kind
from .plan import ModelExecutePlan

__all__ = [
    "LayerProfile",
    "LayerSizes",
    "StageMemory",
    "check_plan_fits",
    "format_bytes",
    "layer_sizes",
    "loss_transient_bytes",
    "measure_activation_bytes",
    "profile_of",
    "scale_activation_bytes",
    "size_prior_ms",
    "stage_memory",
]

#: Milliseconds assumed per byte of dense layer weights before anything was measured
#: (only ratios matter to the planner; the scale keeps the numbers readable).
PRIOR_MS_PER_BYTE = 1.0 / 100e6
#: A layer without dense weights (activation, embedding lookup) is not free: before
#: measurements it costs this share of the largest layer's estimate.
PRIOR_FLOOR_SHARE = 0.01


@dataclass(frozen=True)
class LayerProfile:
    """What the planner knows about one model: per-layer times (ms) and sizes (bytes).

    Attributes:
        fwd_ms: forward time per layer.
        bwd_ms: backward time per layer (without the recompute).
        re_ms: recompute time per layer; ``None`` = the forward time.
        param_bytes: bytes a stage upload moves per layer; ``None`` = 0 (no memory cap).
        grad_bytes: gradient bytes per layer held by backward stages; ``None`` = ``param_bytes``.
        act_bytes: saved-activation bytes per layer for one microbatch, held while a
            backward or fused stage runs; ``None`` = 0.
    """

    fwd_ms: Sequence[float]
    bwd_ms: Sequence[float]
    re_ms: Sequence[float] | None = None
    param_bytes: Sequence[int] | None = None
    grad_bytes: Sequence[int] | None = None
    act_bytes: Sequence[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.fwd_ms)
        if n < 1:
            raise ValueError("a layer profile needs at least one layer")
        names = ("fwd_ms", "bwd_ms", "re_ms", "param_bytes", "grad_bytes", "act_bytes")
        for name in names[1:]:
            seq = getattr(self, name)
            if seq is not None and len(seq) != n:
                raise ValueError(
                    f"{name} has {len(seq)} entries but fwd_ms has {n}; give one per layer"
                )
        for name in names:
            for i, x in enumerate(getattr(self, name) or ()):
                if not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
                    raise ValueError(f"{name}[{i}] = {x!r} must be a finite number >= 0")

    @property
    def num_layers(self) -> int:
        """Layers in the profile."""
        return len(self.fwd_ms)

    @classmethod
    def from_timer(cls, timer: Any, act_bytes: Sequence[float] | None = None) -> LayerProfile:
        """The current estimates of a :class:`~roundpipe_core.running.timer.ModelTimer`
        (``act_bytes`` default: its ``layer_activation_bytes``)."""
        if act_bytes is None:
            act_bytes = getattr(timer, "layer_activation_bytes", None)
        return cls(
            fwd_ms=timer.fwd_ms,
            bwd_ms=timer.bwd_ms,
            re_ms=timer.re_ms,
            param_bytes=timer.layer_param_bytes,
            grad_bytes=getattr(timer, "layer_grad_bytes", None),
            act_bytes=act_bytes,
        )

    def layer_ms(self) -> tuple[list[float], list[float], list[float]]:
        """Forward, recompute (default: the forward) and backward ms per layer."""
        fwd = [float(x) for x in self.fwd_ms]
        re = [float(x) for x in self.re_ms] if self.re_ms is not None else fwd
        return fwd, re, [float(x) for x in self.bwd_ms]

    def layer_bytes(self) -> tuple[list[float], list[float], list[float]]:
        """Parameter, gradient and activation bytes per layer, the defaults filled in."""
        n = self.num_layers
        params = [float(x) for x in self.param_bytes] if self.param_bytes is not None else [0.0] * n
        grads = [float(x) for x in self.grad_bytes] if self.grad_bytes is not None else params
        acts = [float(x) for x in self.act_bytes] if self.act_bytes is not None else [0.0] * n
        return params, grads, acts

    def stage_mem(self) -> tuple[list[float], list[float]]:
        """Bytes per layer held by a forward stage (parameters) and by a backward or
        fused stage (parameters + gradients + one microbatch's saved activations)."""
        params, grads, acts = self.layer_bytes()
        return params, [p + g + a for p, g, a in zip(params, grads, acts)]


@dataclass(frozen=True)
class LayerSizes:
    """Bytes per layer, from the modules.

    Attributes:
        upload_bytes: parameters + buffers a stage upload moves (a shared tensor in
            each stage that uses it).
        grad_bytes: trainable parameters (gradients a backward stage holds).
        compute_bytes: dense weights: parameters of ``nn.Embedding`` / ``EmbeddingBag``
            are left out unless the layer also uses the tensor in a dense op.
        parameter_bytes: the parameters among ``upload_bytes`` (what an upload to
            host memory lends instead of copying, ``Worker.lend_in``).
    """

    upload_bytes: list[int]
    grad_bytes: list[int]
    compute_bytes: list[int]
    parameter_bytes: list[int]


def layer_sizes(layers: Sequence[nn.Module] | nn.Module) -> LayerSizes:
    """Measure :class:`LayerSizes` of an ``nn.Sequential`` (or a list of layers)."""
    if isinstance(layers, nn.Module):
        layers = list(layers.children()) if isinstance(layers, nn.Sequential) else [layers]
    upload, grads, compute, params = [], [], [], []
    for layer in layers:
        seen: set[int] = set()
        up = gr = pa = 0
        for t in list(layer.parameters()) + list(layer.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            up += t.nbytes
            if isinstance(t, nn.Parameter):
                pa += t.nbytes
                if t.requires_grad:
                    gr += t.nbytes
        lookup: set[int] = set()
        dense: set[int] = set()
        for mod in layer.modules():
            direct = list(mod.parameters(recurse=False))
            target = lookup if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) else dense
            target.update(id(p) for p in direct)
        comp = sum(p.nbytes for p in layer.parameters() if id(p) not in lookup or id(p) in dense)
        upload.append(up)
        grads.append(gr)
        compute.append(comp)
        params.append(pa)
    return LayerSizes(upload, grads, compute, params)


def size_prior_ms(compute_bytes: Sequence[int]) -> list[float]:
    """Forward time per layer before any measurement: proportional to dense weights,
    with a floor of :data:`PRIOR_FLOOR_SHARE` of the largest layer."""
    raw = [b * PRIOR_MS_PER_BYTE for b in compute_bytes]
    top = max(raw, default=0.0)
    floor = top * PRIOR_FLOOR_SHARE if top > 0 else 1.0
    return [max(r, floor) for r in raw]


#: fp32 copies of the last layer's output a loss holds at its peak (an estimate):
#: cross-entropy upcasts the logits and keeps the log-softmax, its backward a gradient.
LOSS_TRANSIENT_FP32_COPIES = 2


def loss_transient_bytes(output: Any) -> int:
    """Bytes the loss adds on top of the last layer's saved tensors: its output (the
    logits) and ``LOSS_TRANSIENT_FP32_COPIES`` fp32 copies of its floating-point tensors."""
    total = 0
    for t in pytree.tree_leaves(output):
        if not isinstance(t, torch.Tensor):
            continue
        total += t.nbytes
        if t.is_floating_point():
            total += LOSS_TRANSIENT_FP32_COPIES * t.numel() * 4
    return total


def measure_activation_bytes(
    layers: Sequence[nn.Module] | nn.Module,
    *args: Any,
    with_loss_transient: bool = False,
    **kwargs: Any,
) -> list[int]:
    """Saved-tensor bytes per layer of one forward with autograd (``nn.Sequential``
    semantics: layer 0 gets ``(*args, **kwargs)``), each storage counted once per layer,
    parameters and buffers left out. With ``with_loss_transient`` the last layer also
    counts :func:`loss_transient_bytes` of its output. Run it on a small batch and
    :func:`scale_activation_bytes` to the real one.
    """
    if isinstance(layers, nn.Module):
        layers = list(layers.children()) if isinstance(layers, nn.Sequential) else [layers]
    state = {
        t.untyped_storage().data_ptr()
        for layer in layers
        for t in list(layer.parameters()) + list(layer.buffers())
    }
    out: list[int] = []
    x: Any = None
    with torch.enable_grad():
        for i, layer in enumerate(layers):
            counter = _SavedBytes(state)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                x = layer(*args, **kwargs) if i == 0 else layer(x)
            out.append(sum(counter.seen.values()))
            # Detach between layers: each layer's graph is measured on its own.
            x = pytree.tree_map_only(
                torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), x
            )
    if with_loss_transient and out:
        out[-1] += loss_transient_bytes(x)
    return out


class _SavedBytes:
    """Pack hook that adds up the storages autograd saves, each once, skipping ``state``."""

    def __init__(self, state: set[int]) -> None:
        self.state = state
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # A detached alias: a node saving its own output (sigmoid, exp) would otherwise
        # hold it, grad_fn and all, from C++ -- a cycle that kept the graph alive.
        if t.device.type == "meta":  # no storage to share: count the tensor
            self.seen[id(t)] = t.nbytes
            return t.detach()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.state:  # a view keeps its whole storage alive
            self.seen[ptr] = max(self.seen.get(ptr, 0), storage.nbytes())
        return t.detach()


def scale_activation_bytes(
    measured: Sequence[float], measured_tokens: int, tokens: int
) -> list[float]:
    """Activation bytes for ``tokens`` tokens per microbatch from a measurement at
    ``measured_tokens`` (saved tensors grow with the tokens)."""
    if measured_tokens < 1 or tokens < 1:
        raise ValueError(
            f"token counts must be >= 1, got measured_tokens={measured_tokens}, tokens={tokens}"
        )
    return [float(b) * tokens / measured_tokens for b in measured]


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage (``kind``, index ``stage`` in its plan, ``layers``) holds while it
    runs: parameters, gradients and one microbatch's saved activations (the last two 0
    for a forward stage)."""

    kind: JobKind
    stage: int
    layers: range
    param_bytes: float
    grad_bytes: float
    act_bytes: float

    @property
    def total_bytes(self) -> float:
        """Everything the running stage holds."""
        return self.param_bytes + self.grad_bytes + self.act_bytes


def stage_memory(
    plan: ModelExecutePlan, profile: LayerProfile, run_type: RunType | str
) -> list[StageMemory]:
    """What each stage of ``plan`` holds while it runs, in launch order."""
    rt = parse_kind(RunType, run_type, "run_type")
    params, grads, acts = profile.layer_bytes()
    out = [
        StageMemory(JobKind.FORWARD, i, r, sum(params[j] for j in r), 0.0, 0.0)
        for i, r in enumerate(plan.fwd_plan)
    ]
    for i, r in enumerate(plan.bwd_plan if rt != RunType.INFER else []):
        kind = JobKind.FUSED if (rt == RunType.FUSED and i == 0) else JobKind.BACKWARD
        held = [sum(b[j] for j in r) for b in (params, grads, acts)]
        out.append(StageMemory(kind, i, r, *held))
    return out


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units for messages: ``"12.0 MiB"``, ``"1.50 GiB"``."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def check_plan_fits(
    plan: ModelExecutePlan,
    profile: LayerProfile,
    run_type: RunType | str,
    capacity_bytes: float,
) -> None:
    """Refuse a plan whose stages cannot fit a device of ``capacity_bytes``: each stage
    plus the largest other stage's parameters (round-robin may prefetch any next) must
    fit, and a backward or fused stage also holds its largest layer's gradient once more
    (a fresh one being added to the accumulated one, measured on fake CUDA).

    Raises:
        ValueError: naming the stage, its layers and the bytes it needs.
    """
    if not capacity_bytes > 0:
        raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes!r}")
    stages = stage_memory(plan, profile, run_type)
    _, grads, _ = profile.layer_bytes()
    for s in stages:
        prefetch = max((o.param_bytes for o in stages if o is not s), default=0.0)
        forward = s.kind == JobKind.FORWARD
        accumulating = 0.0 if forward else max((grads[j] for j in s.layers), default=0.0)
        need = s.total_bytes + accumulating + prefetch
        if need > capacity_bytes:
            raise ValueError(
                f"{s.kind} stage {s.stage} (layers {s.layers.start}..{s.layers.stop - 1}) needs "
                f"{format_bytes(need)} on its device (parameters {format_bytes(s.param_bytes)}, "
                f"gradients {format_bytes(s.grad_bytes)} and one being accumulated "
                f"{format_bytes(accumulating)}, activations of one microbatch "
                f"{format_bytes(s.act_bytes)}, next stage's prefetched parameters "
                f"{format_bytes(prefetch)}) but the device has {format_bytes(capacity_bytes)}; "
                "split the stage, use fewer tokens per microbatch (more microbatches), or "
                "recompute_grain='layer'"
            )


def profile_of(model: Any) -> LayerProfile:
    """The planner's view of one model: a :class:`LayerProfile` as given, a
    ``ModelTimer``'s estimates (before measurements: :func:`size_prior_ms`), or a
    RoundPipe model's, with its ``layer_activation_bytes`` when it records them.
    """
    if isinstance(model, LayerProfile):
        return model
    timer = getattr(model, "model_timer", model)
    if not hasattr(timer, "fwd_ms") or not hasattr(timer, "layer_param_bytes"):
        raise TypeError(
            f"{type(model).__name__} is not a RoundPipe model, ModelTimer or LayerProfile; "
            "pass the RoundPipe objects to plan"
        )
    prof = LayerProfile.from_timer(timer, act_bytes=getattr(model, "layer_activation_bytes", None))
    layers = getattr(model, "layers", None)
    if layers is not None and getattr(model, "uploads_lend_parameters", False):
        return _with_lent_parameters(prof, layer_sizes(list(layers)))
    return prof


def _with_lent_parameters(profile: LayerProfile, sizes: LayerSizes) -> LayerProfile:
    """``profile`` for a pool whose uploads lend the host's parameters: only what is still
    copied (buffers, quantized state) counts as upload; gradients are real memory."""
    uploads, grads, _ = profile.layer_bytes()
    lent = sizes.parameter_bytes
    return replace(
        profile,
        param_bytes=[max(0, int(u) - int(p)) for u, p in zip(uploads, lent)],
        grad_bytes=[int(g) for g in grads],
    )
