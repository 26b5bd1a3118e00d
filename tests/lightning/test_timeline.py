"""The timeline picture: a real pipelined iteration above its simulation, as an image
array for TensorBoard and as a PNG with the same pixels."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.planning.simulate import simulate
from roundpipe_core.running import trace as core_trace
from roundpipe_core.running.trace import Span, spans_from_roundpipe
from roundpipe_lightning import timeline
from roundpipe_lightning.timeline import KIND_COLORS, render_timeline, spans_from_simulation

pytestmark = [pytest.mark.host_only]

matplotlib_image = pytest.importorskip("matplotlib.image")

PLAN = ModelExecutePlan([range(0, 4)], [range(4, 6), range(2, 4), range(0, 2)])


class _Sleep(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _Sleep()) for _ in range(6)])


def _rgb(color: str) -> np.ndarray:
    return np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)


def _has_color(image: np.ndarray, color: str, min_pixels: int = 50) -> bool:
    close = np.abs(image.astype(np.int16) - _rgb(color)).max(axis=-1) <= 2
    return int(close.sum()) >= min_pixels


@pytest.fixture(scope="module")
def measured_and_simulated():
    """One real non-blocking iteration with its timed optimizer step, and the same
    plan simulated with the timer's per-layer estimates."""
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN)
    rp = RoundPipe(_model(), devices="cpu:2", model_run_config=cfg)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
    try:
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        loss_fn = torch.nn.functional.mse_loss
        rp.forward_backward((x,), label=y, loss_fn=loss_fn, blocking=False).result(timeout=60)
        # step() times its step_fn itself: the optimizer row comes with the call's spans
        rp.step(lambda: (time.sleep(0.005), opt.step(), opt.zero_grad()))
        rp.synchronize()
        measured = spans_from_roundpipe(rp)
    finally:
        rp.close()
    sim = simulate(PLAN, [2.0] * 6, [3.0] * 6, 2, 2, upload_ms=0.2)
    return measured, spans_from_simulation(sim, iteration=-1)


def test_renders_a_real_run_beside_its_simulation(measured_and_simulated, tmp_path):
    measured, simulated = measured_and_simulated
    assert {s.args["kind"] for s in measured if s.lane == "compute"} == {
        "forward",
        "fused",
        "backward",
    }
    path = tmp_path / "plots" / "timeline.png"
    image = render_timeline(measured, simulated, path, title="test run", width_px=900)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert image.shape[1] == 900 and 300 <= image.shape[0] <= 900
    png = matplotlib_image.imread(path)
    assert png.shape[:2] == image.shape[:2]
    assert np.array_equal((png[..., :3] * 255).round().astype(np.uint8), image)
    for kind in ("forward", "fused", "backward", "upload", "optimizer"):
        assert _has_color(image, KIND_COLORS[kind]), f"no {kind} bar drawn"
    # measured only: one panel, so a smaller picture
    alone = render_timeline(measured, None, width_px=900)
    assert alone.shape[1] == 900 and alone.shape[0] < image.shape[0]
    assert _has_color(alone, KIND_COLORS["upload"])  # the measured uploads of the run


def test_image_logs_to_tensorboard(measured_and_simulated, tmp_path):
    tb = pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    image = render_timeline(*measured_and_simulated)
    writer = tb.SummaryWriter(str(tmp_path))
    writer.add_image("roundpipe/timeline", image, 3, dataformats="HWC")
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    (event,) = acc.Images("roundpipe/timeline")
    assert (event.step, event.height, event.width) == (3, image.shape[0], image.shape[1])


def test_both_panels_share_one_time_scale():
    """A simulated iteration twice as long as the measured one draws bars twice as wide."""
    measured = [Span(0, "compute", "0X0", 0.0, 0.010, {"kind": "fused"})]
    simulated = [Span(0, "compute", "0X0", 0.0, 0.020, {"kind": "fused"})]
    image = render_timeline(measured, simulated, width_px=800)
    close = np.abs(image.astype(np.int16) - _rgb(KIND_COLORS["fused"])).max(axis=-1) <= 2
    rows = np.nonzero(close.any(axis=1))[0]
    groups = np.split(rows, np.nonzero(np.diff(rows) > 1)[0] + 1)
    # bars, not the legend's small colour patch
    widths = [int(close[g].sum(axis=1).max()) for g in groups]
    bars = [w for w in widths if w > 100]
    assert len(bars) == 2, f"expected one bar per panel, got widths {widths}"
    width_top, width_bottom = bars
    assert width_bottom == pytest.approx(2 * width_top, rel=0.05)


def test_spans_from_simulation_is_the_core_converter():
    assert timeline.spans_from_simulation is core_trace.spans_from_simulation


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no spans to draw"):
        render_timeline([], None)
    with pytest.raises(
        TypeError, match="measured must be a list of roundpipe_core.running.trace.Span"
    ):
        render_timeline([("job", 0, 0.0, 1.0)])  # type: ignore[list-item]
    ok = [Span(0, "compute", "0F0", 0.0, 1.0)]
    with pytest.raises(ValueError, match="width_px must be"):
        render_timeline(ok, width_px=10)
