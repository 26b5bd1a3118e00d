"""Lifecycle: a dropped RoundPipe is collectable, the optimizer thread never holds up
interpreter exit, and an asynchronous step error nobody saw is reported."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from _util import mlp, sum_sq

from roundpipe_core import RoundPipe

_ROOT = Path(__file__).parents[2]


def test_dropped_roundpipe_is_garbage_collected() -> None:
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(mlp(), devices="cpu:2")
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    rp.forward_backward((x,), label=y, loss_fn=sum_sq)
    rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False).result(timeout=60)
    rp.step(lambda: (opt.step(), opt.zero_grad()))
    sum_sq(rp(x), y).backward()
    with torch.no_grad():
        rp(x)
    ref = weakref.ref(rp)
    del rp
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def test_a_finished_call_is_freed_without_the_garbage_collector() -> None:
    # a loop of calls without a step in between keeps memory flat: each call's run (its
    # losses, outputs and timing records) goes with its handle, by reference counting
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(mlp(), devices="cpu:2")
    rp.forward_backward((x,), label=y, loss_fn=sum_sq)
    gc.collect()
    gc.disable()
    try:
        runs = []
        for _ in range(3):
            handle = rp.forward_backward(
                (x,), label=y, loss_fn=sum_sq, return_outputs=True, blocking=False
            )
            handle.result(timeout=60)
            runs.append(weakref.ref(handle.run))
            del handle
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        alive = [r() for r in runs]
        assert alive == [None] * 3, [
            [type(o).__name__ for o in gc.get_referrers(run)] for run in alive if run is not None
        ]
    finally:
        gc.enable()
        rp.close()  # its threads end now, not at some later collection


def _run(
    script: str, timeout: float = 90.0, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


_PRELUDE = """
    import threading, torch
    from torch import nn
    from roundpipe_core import RoundPipe
    rp = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), devices="cpu:2", shared_masters=False)
    rp.forward_backward((torch.randn(3, 4),), label=None, loss_fn=lambda o, _: o.sum())
"""


@pytest.mark.host_only  # all in child processes
def test_a_stuck_step_does_not_hang_interpreter_exit() -> None:
    proc = _run(
        _PRELUDE
        + """
    started = threading.Event()
    def stuck():
        started.set()
        threading.Event().wait()  # never returns
    rp.step(stuck, is_async=True)
    started.wait(30)
    print("leaving")
    """,
        env_extra={"ROUNDPIPE_EXIT_WAIT_S": "0.5"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "leaving" in proc.stdout
    assert "RuntimeWarning" in proc.stderr and "it is dropped" in proc.stderr, proc.stderr


@pytest.mark.host_only  # all in child processes
@pytest.mark.parametrize("raise_at_end", [False, True])
def test_exit_with_a_step_in_flight_finishes_it(raise_at_end: bool) -> None:
    """A script that ends (or raises) while the optimizer thread is inside torch kernels:
    exit waits for the step instead of aborting the process (SIGABRT, exit 134)."""
    proc = _run(
        _PRELUDE
        + f"""
    big = torch.randn(600, 600)
    def slow():
        for _ in range(40):
            big @ big
        print("step finished", flush=True)
    rp.step(slow, is_async=True)
    print("leaving", flush=True)
    if {raise_at_end}:
        raise SystemExit("user error")
    """
    )
    assert proc.returncode == (1 if raise_at_end else 0), proc.stderr
    assert proc.stdout.split() == ["leaving", "step", "finished"], proc.stdout


@pytest.mark.host_only  # all in child processes
def test_unobserved_step_error_is_reported_at_exit() -> None:
    proc = _run(
        _PRELUDE
        + """
    def bad():
        raise ValueError("step went wrong")
    rp.step(bad, is_async=True)
    rp.wait_step()
    """
    )
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" in proc.stderr and "step went wrong" in proc.stderr, proc.stderr


@pytest.mark.host_only  # all in child processes
def test_observed_step_error_is_not_reported_again() -> None:
    proc = _run(
        _PRELUDE
        + """
    def bad():
        raise ValueError("step went wrong")
    rp.step(bad, is_async=True)
    try:
        rp.synchronize()
    except ValueError:
        print("seen")
    """
    )
    assert proc.returncode == 0, proc.stderr
    assert "seen" in proc.stdout and "RuntimeWarning" not in proc.stderr, proc.stderr
