"""The engine's cheap paths keep the behaviour of the general ones they replace:
the layer frame seen by model code, the direct autograd-engine backward, bulk timer
records, batched ledger counts and a failure's one note."""

from __future__ import annotations

import pytest
import torch
from _util import assert_close_rel, mlp, reference_grads, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.context import current_layer, current_microbatch, doing_recompute
from roundpipe_core.running import runtime
from roundpipe_core.running.devices.base import MemoryLedger
from roundpipe_core.running.timer import ModelTimer

_SEEN: list[tuple] = []  # module level: every replica of a layer appends here


class _Spy(nn.Module):
    """Records what the engine's context says while it runs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SEEN.append((current_layer(), current_microbatch(), doing_recompute()))
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_layer_frame_names_each_layer_and_is_gone_around_the_loss(grain: str) -> None:
    _SEEN.clear()
    model = nn.Sequential(*[_Spy(4) for _ in range(6)])
    loss_frames: list = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss_frames.append((current_layer(), current_microbatch(), doing_recompute()))
        return sum_sq(out, y)

    plan = ModelExecutePlan.uniform(6, 3, "fused")  # fused stage: layers 4, 5
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    rp = RoundPipe(model, devices="cpu:2", model_run_config=cfg)
    try:
        rp.forward_backward((torch.randn(4, 4),), label=torch.randn(4, 4), loss_fn=loss_fn)
    finally:
        rp.close()
    # layers run outside the pipeline too (the plan-fit check measures activations
    # on the host, where there is no frame): those records have no layer
    inside = [s for s in _SEEN if s[0] is not None]
    forward = sorted(s for s in inside if not s[2])
    recompute = sorted(s for s in inside if s[2])
    assert forward == [(layer, mb, False) for layer in range(6) for mb in range(2)]
    # the fused last stage (layers 4, 5) is not recomputed; grain "layer" recomputes twice
    times = 2 if grain == "layer" else 1
    assert recompute == sorted([(layer, mb, True) for layer in range(4) for mb in range(2)] * times)
    assert loss_frames == [(None, None, False)] * 2


def test_direct_engine_backward_equals_the_public_path(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=ModelExecutePlan.uniform(6, 3, "fused"))
    assert runtime._run_backward is not None  # this torch has the engine entry
    calls = []
    direct = runtime._run_backward

    def counting(*args, **kwargs):
        calls.append(1)
        return direct(*args, **kwargs)

    grads = {}
    for name, entry in (("direct", counting), ("public", None)):
        monkeypatch.setattr(runtime, "_run_backward", entry)
        model = mlp()
        rp = RoundPipe(model, devices="cpu:2", model_run_config=cfg)
        try:
            rp.forward_backward((x,), label=y, loss_fn=sum_sq)
            grads[name] = {n: p.grad.clone() for n, p in rp.optim_named_parameters()}
        finally:
            rp.close()
    assert calls, "the direct path was never taken"
    assert grads["direct"].keys() == grads["public"].keys()
    for n in grads["direct"]:
        assert torch.equal(grads["direct"][n], grads["public"][n]), n
    _, ref = reference_grads(mlp(), x, y)
    for n, g in ref.items():
        assert_close_rel(grads["direct"][n], g, what=n)


def test_records_are_per_microbatch_and_split_without_loss() -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 8), nn.ReLU()]
    records = [("fwd", range(0, 1), 2.0), ("bwd", range(0, 3), 9.0), ("re", [1, 2], 4.0)]
    timer = ModelTimer(layers)
    for _ in range(3):
        for kind, layer_range, ms in records:
            timer.record(kind, layer_range, ms, microbatches=2)
        timer.end_iteration()
    # per microbatch, and a stage's time split over its layers without loss
    assert timer.fwd_ms[0] == pytest.approx(1.0)
    assert sum(timer.bwd_ms) == pytest.approx(4.5)
    assert timer.re_ms[1] + timer.re_ms[2] == pytest.approx(2.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (("fwd", range(0, 4), 1.0), "layer 3 is outside"),
        (("fwd", [2, -1], 1.0), "layer -1 is outside"),
        (("fwd", range(0, 1), float("nan")), "finite"),
        (("forward", range(0, 1), 1.0), "timing kind"),
    ],
)
def test_record_refuses_bad_records_and_keeps_none(bad: tuple, match: str) -> None:
    timer = ModelTimer([nn.Linear(2, 2) for _ in range(3)])
    with pytest.raises(ValueError, match=match):
        timer.record(*bad)
    timer.end_iteration()
    assert not timer.has_measurements()  # nothing of the refused record landed


def test_ledger_counts_batches_with_the_same_peaks() -> None:
    ledger = MemoryLedger()
    ledger.alloc(100, "param")
    ledger.alloc(50, "activation")
    ledger.free(100, "param")
    ledger.alloc(30, "param")
    assert ledger.current == {"param": 30, "activation": 50}
    assert ledger.peak == {"param": 100, "activation": 50}
    ledger.free(30, "param")
    ledger.free(50, "activation")
    assert ledger.current == {"param": 0, "activation": 0}


class _Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("boom")


@pytest.mark.parametrize("kind", ["fused", "infer"])
def test_a_failing_layer_gets_one_note_naming_it(kind: str) -> None:
    model = mlp()
    model[2] = _Boom()
    rp = RoundPipe(model, devices="cpu:2")
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    try:
        with pytest.raises(ArithmeticError, match="boom") as info:
            if kind == "fused":
                rp.forward_backward((x,), label=y, loss_fn=sum_sq)
            else:
                with torch.no_grad():
                    rp(x)
    finally:
        rp.close()
    notes = [n for n in getattr(info.value, "__notes__", []) if n.startswith("RoundPipe:")]
    assert len(notes) == 1, notes
    assert "layer 2, microbatch" in notes[0]
