"""The equivalence checker: passes equivalent plans, catches planted bugs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, doing_recompute
from roundpipe_core.verify import compare_plans, example_model, main


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def data(batch: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(batch, 8, generator=gen), torch.randn(batch, 4, generator=gen)


def test_example_model_matches_under_several_layouts():
    x, y = data()
    plans = [
        "3,3",  # symmetric, round-robin
        "1,2,3",
        "0:2,0:1,1:3",  # explicit owners
        "fwd=5 bwd=1:1,0:2,1:3",  # asymmetric, owners on the backward side
        ModelExecutePlan.from_layout(fwd="", bwd="6", run_type="fused"),  # one fused stage
    ]
    report = compare_plans(lambda: example_model(6), x, y, mse, plans, devices=2, num_microbatch=3)
    assert report.ok, report.table()
    assert len(report.plans) == len(plans)
    for p in report.plans:
        assert len(p.layers) == 6
        acts, params = p.tensors_compared
        assert params == 2 + 4 * 6 + 4  # Linear(8,16); 4 blocks x 6 tensors; LayerNorm + Linear
        assert acts >= 2 * 6  # every layer's output and output gradient
        assert p.loss.count == 1
    # Layers of forward stages were recomputed and compared with their forward.
    assert report.plans[0].layers[0].recompute is not None
    assert report.plans[0].layers[5].recompute is None  # fused stage: no recompute
    text = report.table()
    assert "[PASS] 0:2,0:1,1:3" in text and "fwd=0:2,0:1 bwd=1:3,0:1,0:2" in text


def test_layer_recompute_grain_matches():
    x, y = data()
    report = compare_plans(
        lambda: example_model(5), x, y, mse, ["1,1,3"], devices="cpu:3", recompute_grain="layer"
    )
    assert report.ok, report.table()


class DriftingRecompute(nn.Linear):
    """A planted bug: the recompute does not reproduce the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * 1.01 if doing_recompute() else out


def buggy_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), DriftingRecompute(16, 16), nn.Tanh(), nn.Linear(16, 4))


def test_catches_a_layer_whose_recompute_differs():
    x, y = data()
    # Layer 1 sits in a forward stage, so the backward recomputes it.
    report = compare_plans(buggy_model, x, y, mse, ["2,2"], devices=2)
    assert not report.ok
    layer1 = report.plans[0].layers[1]
    assert layer1.recompute is not None and not layer1.recompute.ok
    assert layer1.recompute.max_rel == pytest.approx(0.01, rel=1e-3)
    # The wrong activations reach the parameter gradients of layers 0 and 1.
    assert not report.plans[0].layers[0].param_grad.ok
    assert not report.plans[0].layers[1].param_grad.ok
    assert report.plans[0].layers[1].output.ok  # the forward itself was right
    failures = report.plans[0].failures()
    assert any("layer 1 recompute" in f for f in failures)
    with pytest.raises(AssertionError, match="layer 1 recompute"):
        report.raise_for_failure()
    # With the layer inside the fused stage nothing is recomputed: the plan passes.
    fused = compare_plans(buggy_model, x, y, mse, ["1,3"], devices=2)
    assert fused.ok, fused.table()


def test_nan_fails_the_report():
    def nan_model() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        with torch.no_grad():
            model[1].weight[0, 0] = float("nan")
        return model

    x, y = data()
    report = compare_plans(nan_model, x, y, mse, ["1,1"], devices=2)
    assert not report.ok
    assert report.plans[0].loss.nonfinite
    assert any("NaN/Inf" in f for f in report.plans[0].failures())
    with pytest.raises(AssertionError):
        compare_plans(nan_model, x, y, mse, ["1,1"], devices=2, strict=True)


def test_bad_arguments():
    x, y = data()
    counter = iter(range(100))

    def unseeded() -> nn.Sequential:
        torch.manual_seed(next(counter))
        return nn.Sequential(nn.Linear(8, 4))

    with pytest.raises(ValueError, match="different weights on two calls"):
        compare_plans(unseeded, x, y, mse, ["1"])
    with pytest.raises(ValueError, match="has 5 layers .* the model has 6"):
        compare_plans(lambda: example_model(6), x, y, mse, ["2,3"])
    with pytest.raises(ValueError, match="at least one plan"):
        compare_plans(lambda: example_model(6), x, y, mse, [])
    with pytest.raises(ValueError, match="names device 3"):
        compare_plans(lambda: example_model(4), x, y, mse, ["0:2,3:2"], devices=2)


def test_cli(capsys):
    assert main(["--layers", "4", "--plans", "2,2", "0:1,1:3", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "[PASS] 2,2" in out and "[PASS] 0:1,1:3" in out
    assert "all plans match plain PyTorch" in out
    with pytest.raises(SystemExit):
        main(["--layers", "4", "--plans", "2,x"])
