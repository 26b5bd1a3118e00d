"""RoundPipeStrategy with num_nodes=2: two processes on 127.0.0.1 act as nodes (gloo,
CPU backend, 2 devices each), started the way a launcher starts them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _common import ROOT, free_port, reference_run, rel_err

WORKER = Path(__file__).with_name("_strategy_worker.py")
STEPS = 4

pytestmark = [pytest.mark.host_only, pytest.mark.timeout(240)]


def _launch(out: Path, *args: str) -> list[tuple[subprocess.Popen, Path]]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        for k in ("RANK", "SLURM_PROCID", "SLURM_NTASKS", "GROUP_RANK"):
            env.pop(k, None)
        env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "NODE_RANK": str(rank),
                "LOCAL_RANK": "0",
                "OMP_NUM_THREADS": "1",
                "PYTHONFAULTHANDLER": "1",  # a crash prints every thread's stack
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            }
        )
        log = out / f"rank{rank}.log"
        with open(log, "w") as fh:
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(out), *args],
                        env=env,
                        cwd=str(ROOT),
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                    ),
                    log,
                )
            )
    return procs


def _wait(procs, deadline_s: float) -> list[int | None]:
    end = time.monotonic() + deadline_s
    codes: list[int | None] = []
    for p, _ in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    return codes


def _logs(procs) -> str:
    return "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log in procs
    )


def test_two_nodes_train_like_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    procs = _launch(tmp_path, str(STEPS))
    codes = _wait(procs, 200)
    assert codes == [0, 0], _logs(procs)
    r0 = torch.load(tmp_path / "params_rank0.pt")
    r1 = torch.load(tmp_path / "params_rank1.pt")
    ref = reference_run(STEPS, 1)
    for name in ref:
        assert torch.equal(r0[name], r1[name]), f"{name} differs between ranks"
        assert rel_err(r0[name], ref[name]) <= 1e-5, name
    ckpt = torch.load(tmp_path / "final.ckpt", weights_only=True)  # rank 0 wrote it
    for name in ref:
        assert torch.equal(ckpt["state_dict"][f"net.{name}"], r0[name])


def test_a_failing_node_ends_the_job_on_every_node(tmp_path: Path) -> None:
    procs = _launch(tmp_path, str(STEPS), "1")  # rank 1 raises in its second training step
    codes = _wait(procs, 150)  # process-group timeout 15 s: nobody may hang
    assert None not in codes, "a process hung:\n" + _logs(procs)
    assert codes[1] != 0 and codes[0] != 0, _logs(procs)
    assert "rank 1 crashed on purpose" in procs[1][1].read_text(errors="replace")
    # the survivor's first collective after the death is self.log(sync_dist=True): it names
    # the rank and the likely cause instead of gloo's bare "Connection reset/closed by peer"
    assert "all_reduce(mean) failed on rank 0 of 2" in procs[0][1].read_text(errors="replace"), (
        _logs(procs)
    )
