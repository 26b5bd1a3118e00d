"""``benchmarks/step_cost.py`` still runs against the engine (it reaches into the masters
and the weight versions, which may move): a tiny size, one round, no timing asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_only

ROOT = Path(__file__).resolve().parents[2]


def test_step_cost_benchmark_runs_and_prints_every_row():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "step_cost.py", "--params", "4e3", "--width", "32", "--rounds", "1"],
        cwd=ROOT / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for dtype in ("fp32", "bf16"):
        assert f"{dtype} weights, fp32 masters" in out.stdout
    lines = out.stdout.splitlines()

    def rows(name: str) -> int:  # rows whose name is exactly ``name``
        return sum(line.startswith(name + "  ") for line in lines)

    for row in (
        "torch fused AdamW",
        "torch fused AdamW, in a loop",
        "rp step(sync)",
        "  merge",
        "  copy, Python thread busy",
        "  same as a loop, busy",
        "  copy to model",
        "rp step(async): caller",
        "async: optimizer thread",
        "publish (pipelined)",
        "prototype: layered step+copy",
    ):
        assert rows(row) == 2, row
    assert rows("rp step(sync), shared masters") == 1  # fp32 weights only
    assert rows("torch fused AdamW + cast copy") == 1  # bf16 weights only
