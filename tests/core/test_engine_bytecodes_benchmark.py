"""``benchmarks/engine_bytecodes.py`` counts the engine's bytecodes on every thread: the
CPU worker's functions show up in its list beside the caller's, and a call of more
layers counts more. No count is asserted exactly: a wait that times out under load
runs its loop once more."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_only

ROOT = Path(__file__).resolve().parents[2]


def test_engine_bytecodes_counts_the_worker_and_the_caller():
    out = subprocess.run(
        [sys.executable, "engine_bytecodes.py", "--layers", "4", "16"]
        + ["--microbatches", "1", "--calls", "1", "--top", "1000"],
        cwd=ROOT / "benchmarks",
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    totals = [
        int(n.replace(",", ""))
        for n in re.findall(r"jobs: ([\d,]+) bytecodes per call", out.stdout)
    ]
    assert len(totals) == 2 and 0 < totals[0] < totals[1], out.stdout
    # the worker thread runs the jobs; the caller issues the call and merges its gradients
    assert "roundpipe_core/running/runtime.py:_microbatch" in out.stdout, out.stdout
    assert "roundpipe_core/model.py:forward_backward" in out.stdout, out.stdout
