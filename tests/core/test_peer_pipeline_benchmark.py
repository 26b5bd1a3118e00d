"""``benchmarks/peer_pipeline.py`` runs end to end at its ``--quick`` shapes: the
``torch.distributed.pipelining`` ranks start, answer and stop, every variant is timed,
and all variants compute the same loss at step 0 and after one optimizer step (the
script stops on a mismatch; this test reads the printed losses itself as well). No
timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_only

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = (
    "plain",
    "plain + checkpoint",
    "peer GPipe",
    "peer 1F1B",
    "rp cpu:1",
    "rp cpu:2",
    "rp cpu:2 one at a time",
)


def _losses(stdout: str, step: int) -> dict[str, float]:
    """The ``name  loss`` lines under the ``step-N loss`` header."""
    block = stdout.split(f"step-{step} loss per variant", 1)[1].splitlines()[1:]
    out = {}
    for line in block:
        m = re.fullmatch(r"  (.+?)\s+(-?\d+\.\d+)", line)
        if m is None:
            break
        out[m.group(1)] = float(m.group(2))
    return out


def test_peer_pipeline_benchmark_runs_every_variant_on_the_same_arithmetic():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "peer_pipeline.py", "--quick"],
        cwd=ROOT / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for name in VARIANTS:  # one table row each: name, then the median
        assert sum(re.match(re.escape(name) + r"\s+\d", line) is not None for line in lines) == 1
    for step in (0, 1):
        losses = _losses(out.stdout, step)
        assert set(losses) == set(VARIANTS), losses
        ref = losses["plain"]
        assert all(abs(v - ref) <= 1e-5 * abs(ref) for v in losses.values()), losses
    assert _losses(out.stdout, 1)["plain"] != _losses(out.stdout, 0)["plain"]  # it trained
    assert any(line.startswith("target rp cpu:2 / peer 1F1B <= 1.00: ") for line in lines)
    assert any(line.startswith("target rp cpu:2 / rp cpu:1 <= 1.05: ") for line in lines)
