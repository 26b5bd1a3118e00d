"""The fake-CUDA stage of ``.ci/run`` leaves out the tests marked ``host_only``; the
check in ``tests/conftest.py`` (``_host_only_starts_no_worker``) keeps that set honest:
a test so marked that starts a device worker in the test process fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_only  # the probe's workers run in a child process

TESTS = Path(__file__).resolve().parents[1]

_PROBE = """
import pytest
import torch

from roundpipe_core import RoundPipe


@pytest.mark.host_only
def test_marked_but_starts_a_worker():
    rp = RoundPipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), devices="cpu:1")
    rp(torch.randn(3, 2))
    rp.close()


@pytest.mark.host_only
def test_marked_and_pure():
    assert sum(range(4)) == 6


def test_not_marked_starts_a_worker():
    rp = RoundPipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), devices="cpu:1")
    rp(torch.randn(3, 2))
    rp.close()
"""


def test_a_host_only_test_that_starts_a_device_worker_fails(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    env.pop("ROUNDPIPE_TEST_DEVICE", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_probe.py",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-rA",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = out.stdout + out.stderr
    assert "ERROR test_probe.py::test_marked_but_starts_a_worker" in report, report[-3000:]
    assert "is marked host_only but started 1 device worker(s)" in report, report[-3000:]
    assert "PASSED test_probe.py::test_marked_and_pure" in report, report[-3000:]
    assert "PASSED test_probe.py::test_not_marked_starts_a_worker" in report, report[-3000:]


def test_the_fake_cuda_stage_leaves_out_exactly_the_host_only_tests() -> None:
    ci = (TESTS.parent / ".ci" / "run").read_text()
    fake = [line for line in ci.splitlines() if line.startswith("ROUNDPIPE_TEST_DEVICE=fake-cuda")]
    assert len(fake) == 1, fake
    assert '-m "not host_only"' in fake[0] and " tests" in fake[0], fake[0]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (TESTS.parent / "README.md").read_text()
    commands = [line for line in readme.splitlines() if " -m pytest tests" in line]
    assert len(commands) == 1, commands
    readme_args = commands[0].split(" -m pytest ", 1)[1].strip()
    ci = (TESTS.parent / ".ci" / "run").read_text().splitlines()
    assert f"python -m pytest {readme_args}" in ci, (readme_args, ci)


def test_every_test_module_belongs_to_a_wing_of_the_fast_loop() -> None:
    """``scripts/test_wing.py`` runs one wing's tests; a new module must join a wing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "test_wing", TESTS.parent / "scripts" / "test_wing.py"
    )
    assert spec is not None and spec.loader is not None
    wing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wing)
    covered = {p for name in wing.WINGS for p in wing.wing_paths(name)}
    modules = {str(p.relative_to(TESTS.parent)) for p in TESTS.rglob("test_*.py")}
    missing = sorted(
        m for m in modules if m not in covered and not any(m.startswith(c + "/") for c in covered)
    )
    assert not missing, f"test modules in no wing of scripts/test_wing.py: {missing}"
    with pytest.raises(ValueError, match="unknown wing"):
        wing.wing_paths("nowhere")
