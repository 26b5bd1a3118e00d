"""Equivalence checker: a model under execution plans vs plain PyTorch (seed 003),
per layer (:func:`compare_plans`). Forward hooks travel into the device replicas
(deepcopy); ``doing_recompute`` and ``current_microbatch`` place each call. The CLI
(:func:`main`, on a small residual MLP): docs/layouts-and-planner.md.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import batch as batching
from .config import RoundPipeRunConfig
from .context import current_microbatch, doing_recompute
from .model import RoundPipe
from .planning.layout import parse_layout
from .planning.plan import ModelExecutePlan, default_num_microbatch
from .running.devices.pool import DevicePool

PlanSpec = ModelExecutePlan | str | Sequence[Any]


__all__ = [
    "Diff",
    "LayerReport",
    "PlanReport",
    "VerifyReport",
    "compare_plans",
    "example_model",
    "main",
]


@dataclass
class Diff:
    """Largest differences between two sets of tensors.

    Attributes:
        max_abs: ``max |a - b|``.
        max_rel: ``max |a - b| / max |b|`` (0 when both are 0).
        ok: every element satisfies ``|a - b| <= atol + rtol * |b|`` and all are finite.
        nonfinite: a NaN or Inf was seen on either side.
        count: tensors compared.
        note: why the comparison failed beyond tolerance (shape mismatch, missing values).
    """

    max_abs: float = 0.0
    max_rel: float = 0.0
    ok: bool = True
    nonfinite: bool = False
    count: int = 0
    note: str = ""

    def add(
        self, got: torch.Tensor | None, ref: torch.Tensor, atol: float, rtol: float, missing: str
    ) -> None:
        """Compare ``got`` with ``ref``; ``got`` ``None`` fails with ``missing`` as the note."""
        if got is None:
            self.ok = False
            self.note = missing
            return
        self.count += 1
        if got.shape != ref.shape:
            self.ok = False
            self.note = f"shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
            return
        got = got.detach().double()
        ref = ref.detach().double()
        if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
            self.nonfinite = True
            self.ok = False
            self.note = "NaN/Inf"
            return
        if got.numel() == 0:
            return
        err = (got - ref).abs()
        m_abs = float(err.max())
        scale = float(ref.abs().max())
        self.max_abs = max(self.max_abs, m_abs)
        self.max_rel = max(
            self.max_rel, m_abs / scale if scale > 0 else (0.0 if m_abs == 0 else math.inf)
        )
        if not bool((err <= atol + rtol * ref.abs()).all()):
            self.ok = False


@dataclass
class LayerReport:
    """Differences of one layer. ``None`` where nothing of that kind exists."""

    layer: int
    output: Diff
    output_grad: Diff | None
    param_grad: Diff | None
    recompute: Diff | None

    def diffs(self) -> list[tuple[str, Diff]]:
        """``(what, Diff)`` of each comparison this layer has."""
        named = [("output", self.output), ("output grad", self.output_grad)]
        named += [("param grad", self.param_grad), ("recompute", self.recompute)]
        return [(what, d) for what, d in named if d is not None]

    @property
    def ok(self) -> bool:
        return all(d.ok for _, d in self.diffs())


@dataclass
class PlanReport:
    """The comparison of one plan against the reference."""

    label: str
    plan: ModelExecutePlan
    loss: Diff
    layers: list[LayerReport]
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.loss.ok and all(r.ok for r in self.layers)

    @property
    def tensors_compared(self) -> tuple[int, int]:
        """(outputs + output gradients + recomputed outputs, parameter gradients) compared."""
        counts = [(what == "param grad", d.count) for r in self.layers for what, d in r.diffs()]
        return sum(c for p, c in counts if not p), sum(c for p, c in counts if p)

    def failures(self) -> list[str]:
        out = [self.error] if self.error else []
        if not self.loss.ok:
            out.append(f"loss differs by {self.loss.max_abs:.3e} {self.loss.note}".strip())
        for r in self.layers:
            for name, d in r.diffs():
                if not d.ok:
                    out.append(
                        f"layer {r.layer} {name}: max abs {d.max_abs:.3e}, max rel {d.max_rel:.3e}"
                        + (f" ({d.note})" if d.note else "")
                    )
        return out


@dataclass
class VerifyReport:
    """All plans' comparisons; ``ok`` when every plan matched the reference."""

    plans: list[PlanReport]
    atol: float
    rtol: float
    reference_loss: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.plans)

    def raise_for_failure(self) -> None:
        """Raise ``AssertionError`` listing every mismatch, if any."""
        if not self.ok:
            lines = [f"{p.label}: {f}" for p in self.plans for f in p.failures()]
            raise AssertionError("plans differ from plain PyTorch:\n" + "\n".join(lines))

    def table(self) -> str:
        """A per-layer table of the largest differences (max abs / max rel)."""

        def fmt(d: Diff | None, rel: bool = True) -> str:
            if d is None:
                return "-"
            text = f"{d.max_abs:8.1e} /{d.max_rel:8.1e}" if rel else f"{d.max_abs:.1e}"
            return text + ("" if d.ok else " !")

        lines = [f"atol={self.atol:g} rtol={self.rtol:g}  reference loss {self.reference_loss:.6f}"]
        for p in self.plans:
            acts, params = p.tensors_compared
            status = "PASS" if p.ok else "FAIL"
            lines.append("")
            lines.append(
                f"[{status}] {p.label}  ->  {p.plan.to_layout_string()}   "
                f"({acts} outputs/grads, {params} param grads compared; "
                f"loss diff {p.loss.max_abs:.2e})"
            )
            if p.error:
                lines.append(f"  error: {p.error}")
                continue
            lines.append(
                f"  {'layer':>5}  {'output abs/rel':>19}  {'out grad abs/rel':>19}  "
                f"{'param grad abs/rel':>19}  {'recompute abs':>13}"
            )
            for r in p.layers:
                lines.append(
                    f"  {r.layer:>5}  {fmt(r.output):>19}  {fmt(r.output_grad):>19}  "
                    f"{fmt(r.param_grad):>19}  {fmt(r.recompute, rel=False):>13}"
                )
        return "\n".join(lines)


class _Recorder:
    """Forward hooks on ``layers`` that keep each one's outputs and output gradients per
    microbatch."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.lock = threading.Lock()
        n = len(layers)
        self.outputs: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(n)]
        self.recomputed: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(n)]
        self.grads: list[dict[int, dict[int, torch.Tensor]]] = [{} for _ in range(n)]
        for i, layer in enumerate(layers):
            layer.register_forward_hook(self.hook_for(i))

    def hook_for(self, index: int) -> Callable[..., None]:
        # A plain closure: deepcopy keeps functions as they are, so every replica of
        # the layer reports to this recorder.
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            mb = current_microbatch()
            mb = 0 if mb is None else mb
            tensors = [t for t in batching.flatten(output)[0] if isinstance(t, torch.Tensor)]
            store = self.recomputed if doing_recompute() else self.outputs
            with self.lock:
                store[index][mb] = [t.detach().to("cpu", copy=True) for t in tensors]
            for k, t in enumerate(tensors):
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(functools.partial(self._store_grad, index, mb, k))

        return hook

    def _store_grad(self, index: int, mb: int, k: int, g: torch.Tensor) -> None:
        with self.lock:
            self.grads[index].setdefault(mb, {})[k] = g.detach().to("cpu", copy=True)


def _cat(parts: dict[int, list[torch.Tensor]], k: int) -> torch.Tensor | None:
    """Microbatch pieces of output ``k`` joined along the batch dimension."""
    pieces = [parts[m][k] for m in sorted(parts) if k < len(parts[m])]
    if not pieces:
        return None
    return torch.stack(pieces) if pieces[0].dim() == 0 else torch.cat(pieces, dim=0)


def _layers_of(model: nn.Module) -> list[nn.Module]:
    return list(model.children()) if isinstance(model, nn.Sequential) else [model]


def _as_plan(spec: PlanSpec, num_layers: int, num_devices: int) -> tuple[str, ModelExecutePlan]:
    """A plan from a plan object, a ``"fwd=... bwd=..."`` string, or a symmetric layout
    (``"1,2,3"``, ``"0:2,1:4"``: stage sizes from the input side, the last one fused)."""
    if isinstance(spec, ModelExecutePlan):
        return repr(spec), spec
    if isinstance(spec, str) and ("fwd=" in spec or "bwd=" in spec):
        return spec, ModelExecutePlan.from_layout_string(
            spec, num_layers=num_layers, num_devices=num_devices, run_type="fused"
        )
    parsed = parse_layout(spec, "layout")
    if parsed.counts is None:
        raise ValueError(f"layout {spec!r}: give stage sizes ('1,2,3') or device:size pairs")
    if sum(parsed.counts) != num_layers:
        raise ValueError(
            f"layout {spec!r} has {sum(parsed.counts)} layers ({parsed.describe()}) but the "
            f"model has {num_layers}"
        )
    counts, owners = parsed.counts, parsed.owners
    fwd: list[Any] = list(counts[:-1]) if owners is None else list(zip(owners[:-1], counts[:-1]))
    bwd: list[Any] = (
        list(reversed(counts)) if owners is None else list(zip(reversed(owners), reversed(counts)))
    )
    label = spec if isinstance(spec, str) else ",".join(map(str, spec))
    return label, ModelExecutePlan.from_layout(
        fwd=fwd, bwd=bwd, num_layers=num_layers, num_devices=num_devices, run_type="fused"
    )


def compare_plans(
    make_model: Callable[[], nn.Module],
    inputs: Any,
    labels: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    plans: Sequence[PlanSpec],
    devices: Any = 2,
    num_microbatch: int | None = None,
    atol: float = 1e-5,
    rtol: float = 0.0,
    recompute_grain: str = "stage",
    strict: bool = False,
) -> VerifyReport:
    """Run ``make_model()`` under plain PyTorch and under each plan (one
    ``forward_backward`` each); compare the loss and, per layer, the outputs, their
    gradients, the parameter gradients and the recomputed outputs against the forward's
    own. Any NaN/Inf fails.

    Args:
        make_model: builds the model (an ``nn.Sequential``) with the same weights at
            every call (seed inside it), dropout off (the pipeline draws in another order).
        inputs / labels: positional inputs (a tensor or a tuple) and labels.
        loss_fn: ``loss_fn(output, label) -> scalar`` per microbatch.
        plans: ``ModelExecutePlan`` objects, ``"fwd=... bwd=..."`` strings, or symmetric
            layouts (``"1,2,3"``, ``"0:2,1:4"``; see :func:`_as_plan`).
        devices: the RoundPipe device pool (``2``, ``"cpu:3"``, a list of devices).
        num_microbatch: microbatches per call (default: devices + 1,
            :func:`~roundpipe_core.planning.plan.default_num_microbatch` of concurrent
            devices, also on CPU workers, whose own calls run 1 or one per worker).
        atol / rtol: per-element tolerance ``|a - b| <= atol + rtol * |b|``.
        recompute_grain: "stage" or "layer".
        strict: raise ``AssertionError`` on any mismatch instead of only reporting it.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` tells whether every plan matched.
    """
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not plans:
        raise ValueError("give at least one plan or layout to compare")

    ref_model = make_model()
    again = make_model().state_dict()
    for k, a in ref_model.state_dict().items():
        b = again[k]
        same = (
            torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
            if a.is_floating_point() and a.shape == b.shape
            else torch.equal(a, b)
        )
        if not same:
            raise ValueError(
                f"make_model() built different weights on two calls ({k!r} differs); "
                "seed it (torch.manual_seed) so every plan starts from the same model"
            )
    layers = _layers_of(ref_model)
    n = len(layers)
    ref_rec = _Recorder(layers)

    # One device pool for every plan's RoundPipe.
    pool = devices if isinstance(devices, DevicePool) else DevicePool(devices)
    try:
        num_devices = len(pool)
        # The pipeline's microbatch split, reproduced for the reference loss.
        m = num_microbatch or default_num_microbatch(num_devices)
        bs = batching.batch_size_of((inputs, {}))
        sizes = batching.split_sizes(bs, m)
        out = ref_model(*inputs)
        outs = batching.split_tree(out, sizes, bs)
        labs = batching.split_tree(labels, sizes, bs)
        ref_loss = torch.stack([loss_fn(o, y) for o, y in zip(outs, labs)]).sum()
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        ref_outputs = [ref_rec.outputs[i][0] for i in range(n)]
        ref_grads = [ref_rec.grads[i].get(0, {}) for i in range(n)]
        ref_param_grads = {
            name: p.grad for name, p in ref_model.named_parameters() if p.grad is not None
        }
        notes: list[str] = []
        if any(
            isinstance(mod, nn.Dropout) and mod.p > 0 and mod.training
            for mod in ref_model.modules()
        ):
            notes.append(
                "dropout is on: random masks differ between plain PyTorch and the pipeline"
            )

        reports = []
        for spec in plans:
            label, plan = _as_plan(spec, n, num_devices)
            model = make_model()
            rec = _Recorder(_layers_of(model))
            rp = RoundPipe(model, devices=pool)
            try:
                cfg = RoundPipeRunConfig(
                    execute_plan=plan, num_microbatch=m, recompute_grain=recompute_grain
                )
                try:
                    loss = rp.forward_backward(
                        input_args=inputs, label=labels, loss_fn=loss_fn, run_config=cfg
                    )
                except Exception as exc:  # noqa: BLE001 - reported as this plan's failure
                    reports.append(
                        PlanReport(
                            label, plan, Diff(ok=False), [], error=f"{type(exc).__name__}: {exc}"
                        )
                    )
                    continue
                got_params = {name: p.grad for name, p in rp.optim_named_parameters()}
            finally:
                rp.close()
            loss_diff = Diff()
            loss_diff.add(loss.reshape(()), ref_loss.reshape(()), atol, rtol, "")
            layer_reports = []
            for i in range(n):
                out_d, grad_d, par_d, rec_d = Diff(), Diff(), Diff(), Diff()
                for j, ref in enumerate(ref_outputs[i]):
                    out_d.add(
                        _cat(rec.outputs[i], j), ref, atol, rtol, f"output {j} never recorded"
                    )
                for j, ref in ref_grads[i].items():
                    parts = {mb: [g[j]] for mb, g in rec.grads[i].items() if j in g}
                    got = _cat(parts, 0) if len(parts) == len(sizes) else None
                    seen = f"output grad {j} seen for {len(parts)} of {len(sizes)} microbatches"
                    grad_d.add(got, ref, atol, rtol, seen)
                prefix = f"{i}." if isinstance(model, nn.Sequential) else ""
                names = [k for k in ref_param_grads if k.startswith(prefix)]
                for name in names:
                    got = got_params.get(name)
                    par_d.add(got, ref_param_grads[name], atol, rtol, f"no gradient for {name}")
                for mb, tensors in rec.recomputed[i].items():
                    for a, b in zip(tensors, rec.outputs[i].get(mb, [])):
                        rec_d.add(a, b, atol, rtol, "")
                layer_reports.append(
                    LayerReport(
                        i,
                        out_d,
                        grad_d if ref_grads[i] else None,
                        par_d if names else None,
                        rec_d if rec.recomputed[i] else None,
                    )
                )
            reports.append(PlanReport(label, plan, loss_diff, layer_reports))
        report = VerifyReport(reports, atol, rtol, ref_loss.item(), notes)
        if strict:
            report.raise_for_failure()
        return report
    finally:
        if pool is not devices:
            pool.close()


class ResidualBlock(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear, added to the input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def example_model(num_layers: int = 6, width: int = 16, seed: int = 0) -> nn.Sequential:
    """Input projection, residual blocks and an output head: ``num_layers`` layers in all."""
    if num_layers < 2:
        raise ValueError(f"the example model needs at least 2 layers, got {num_layers}")
    torch.manual_seed(seed)
    body = [ResidualBlock(width) for _ in range(num_layers - 2)]
    return nn.Sequential(
        nn.Linear(8, width), *body, nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m roundpipe_core.verify",
        description="Compare the example model under RoundPipe plans with plain PyTorch.",
    )
    parser.add_argument("--layers", type=int, default=6, help="layers of the example model")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument(
        "--plans",
        nargs="+",
        required=True,
        help="layouts: '1,2,3' (stage sizes, last one fused), '0:2,1:4' (device:size), "
        "or 'fwd=2,2 bwd=1:2,0:2' (full plan)",
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--rtol", type=float, default=0.0)
    parser.add_argument("--grain", choices=("stage", "layer"), default="stage")
    args = parser.parse_args(argv)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 8, generator=gen)
    y = torch.randn(args.batch, 4, generator=gen)

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return ((out - label) ** 2).mean()

    try:
        report = compare_plans(
            lambda: example_model(args.layers, args.width),
            x,
            y,
            loss_fn,
            args.plans,
            devices=f"cpu:{args.devices}",
            num_microbatch=args.microbatches,
            atol=args.atol,
            rtol=args.rtol,
            recompute_grain=args.grain,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(report.table())
    for note in report.notes:
        print(f"note: {note}")
    print()
    print("all plans match plain PyTorch" if report.ok else "MISMATCH")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
