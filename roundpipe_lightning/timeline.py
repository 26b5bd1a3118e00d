"""A picture of one pipelined iteration: measured above simulated, on one time scale,
drawn with matplotlib's Agg backend (no display: safe in a training process).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from roundpipe_core.kinds import check_int
from roundpipe_core.running.trace import Span, row_name, rows_of, spans_from_simulation

__all__ = ["KIND_COLORS", "render_timeline", "spans_from_simulation"]

#: Bar colour per kind (a compute span's job kind, else its lane); colour-blind safe.
KIND_COLORS: dict[str, str] = {
    "forward": "#4C72B0",
    "fused": "#8172B3",
    "backward": "#DD8452",
    "upload": "#55A868",
    "activation": "#64B5CD",
    "gradient": "#C44E52",
    "optimizer": "#937860",
    "compute": "#8C8C8C",
}

_LANE_HEIGHT = {"compute": 0.8}  # other lanes are thin rows under their device
_THIN = 0.35


def _check(spans: Sequence[Span] | None, what: str) -> list[Span]:
    spans = list(spans or [])
    wrong = next((s for s in spans if not isinstance(s, Span)), None)
    if wrong is not None:
        raise TypeError(
            f"{what} must be a list of roundpipe_core.running.trace.Span; got {type(wrong).__name__} "
            "(convert a call's timing with spans_from_call, a SimResult with "
            "spans_from_simulation)"
        )
    return spans


def _draw_panel(
    ax: Any, spans: list[Span], title: str, x_max_ms: float, width_px: float
) -> set[str]:
    """Draw one timeline into ``ax``; returns the kinds it used."""
    rows = rows_of(spans)
    t0 = min((s.start_s for s in spans), default=0.0)
    # y position of each row, top to bottom; thin rows take less room
    ypos: dict[tuple[int | None, str], float] = {}
    y = 0.0
    for r in rows:
        h = _LANE_HEIGHT.get(r[1], _THIN)
        ypos[r] = y + h / 2
        y += h + 0.15
    used: set[str] = set()
    px_per_ms = width_px / x_max_ms if x_max_ms > 0 else 0.0
    for s in spans:
        h = _LANE_HEIGHT.get(s.lane, _THIN)
        used.add(s.kind)
        x = (s.start_s - t0) * 1e3
        w = max(s.duration_s * 1e3, 0.0)
        yc = ypos[(s.device, s.lane)]
        ax.broken_barh(
            [(x, w)],
            (yc - h / 2, h),
            facecolors=KIND_COLORS.get(s.kind, KIND_COLORS["compute"]),
            edgecolors="white",
            linewidth=0.6,
        )
        # label a bar only where the text fits inside it (about 7 px per character)
        if s.lane == "compute" and w * px_per_ms > 7.0 * len(s.name) + 4:
            ax.text(x + w / 2, yc, s.name, ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks([ypos[r] for r in rows])
    ax.set_yticklabels([row_name(*r) for r in rows], fontsize=9)
    ax.set_ylim(y, -0.15)  # first device on top
    ax.set_xlim(0, x_max_ms)
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return used


def _extent_ms(spans: list[Span]) -> float:
    if not spans:
        return 0.0
    return (max(s.end_s for s in spans) - min(s.start_s for s in spans)) * 1e3


def render_timeline(
    measured: Sequence[Span],
    simulated: Sequence[Span] | None = None,
    path: str | Path | None = None,
    *,
    title: str | None = None,
    width_px: int = 1200,
    dpi: int = 100,
) -> np.ndarray:
    """Draw the measured iteration (and the simulated one below it) as a picture.

    Args:
        measured: spans of the measured iteration (e.g. ``spans_from_roundpipe(rp)``).
        simulated: spans of the simulated iteration (``spans_from_simulation(sim)``),
            drawn below on the same time scale; ``None``: the measured panel only.
        path: where to save the picture as PNG (parent folders created); ``None``: nowhere.
        title: a line above the panels.
        width_px: picture width in pixels.
        dpi: pixels per inch of the figure (text size in pixels scales with it).

    Returns:
        The picture as an ``H x W x 3`` ``uint8`` array (the PNG's pixels); an
        ImportError without matplotlib.
    """
    meas = _check(measured, "measured")
    sim = _check(simulated, "simulated")
    if not meas and not sim:
        raise ValueError("render_timeline got no spans to draw (measured and simulated are empty)")
    check_int(width_px, "width_px", 200)
    check_int(dpi, "dpi", 10)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "render_timeline needs matplotlib: pip install matplotlib "
            "(or roundpipe-lightning[lightning])"
        ) from exc

    panels: list[tuple[list[Span], str]] = []
    if meas:
        panels.append((meas, f"measured: {_extent_ms(meas):.1f} ms"))
    if simulated is not None:
        panels.append((sim, f"simulated: {_extent_ms(sim):.1f} ms"))
    x_max = max(_extent_ms(p) for p, _ in panels) * 1.02 or 1.0
    # panel heights follow their row counts so a lane has the same height in both
    heights = [
        sum(_LANE_HEIGHT.get(lane, _THIN) + 0.15 for _, lane in rows_of(p)) or 1.0
        for p, _ in panels
    ]
    inch_per_row = 0.42
    fig_h = sum(heights) * inch_per_row + 0.55 * len(panels) + 1.3 + (0.3 if title else 0.0)
    fig = Figure(figsize=(width_px / dpi, fig_h), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(
        len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights}
    )[:, 0]
    used: set[str] = set()
    # the plot area is about 80 % of the figure width (labels on the left)
    for ax, (spans, name) in zip(axes, panels):
        used |= _draw_panel(ax, spans, name, x_max, width_px * 0.8)
        if not spans:
            ax.text(0.5, 0.5, "no spans", transform=ax.transAxes, ha="center", va="center")
    axes[-1].set_xlabel("time (ms)")
    if title:
        fig.suptitle(title, fontsize=11)
    order = [k for k in KIND_COLORS if k in used]
    handles = [Patch(facecolor=KIND_COLORS[k], label=k) for k in order]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=max(1, len(handles)),
        frameon=False,
        fontsize=9,
    )
    # leave a strip at the bottom for the legend
    fig.tight_layout(rect=(0, 0.4 / fig_h, 1, 1))
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].copy()  # type: ignore[attr-defined]
    if path is not None:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi, format="png")
    return image
