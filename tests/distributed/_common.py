"""Shared pieces of the distributed tests: the model, the data, the plain-PyTorch
reference, and a launcher of N local processes acting as nodes.

The worker processes (``_worker.py``) use ``roundpipe_core.distributed``, which
needs only ``torch``: no Lightning start-up cost per process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")

IN_DIM, WIDTH, OUT_DIM = 6, 10, 3
GLOBAL_BATCH = 12  # split in 2 contiguous halves, one per rank


def load_distributed() -> ModuleType:
    """``roundpipe_core.distributed`` (it imports no Lightning, which costs ~7 s per
    process on a 2-core CI box)."""
    import roundpipe_core.distributed

    return roundpipe_core.distributed


def build_model(seed: int = 0) -> nn.Sequential:
    """Five layers (LayerNorm included), plus a frozen layer that must be left alone."""
    torch.manual_seed(seed)
    frozen = nn.Linear(WIDTH, WIDTH)
    frozen.requires_grad_(False)
    return nn.Sequential(
        nn.Linear(IN_DIM, WIDTH),
        nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        frozen,
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        nn.Linear(WIDTH, OUT_DIM),
    )


def make_data(
    steps: int, accum: int, seed: int = 123
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps`` optimizer steps of ``accum`` global micro-batches each."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(GLOBAL_BATCH, IN_DIM, generator=g),
                torch.randn(GLOBAL_BATCH, OUT_DIM, generator=g),
            )
            for _ in range(accum)
        ]
        for _ in range(steps)
    ]


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous part of a global batch (concatenation = the batch)."""
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def make_optimizer(params) -> torch.optim.Optimizer:
    # SGD, not Adam: Adam's update hardly depends on the gradient's scale, so it would
    # hide a missing (or doubled) division by the world size.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def reference_run(steps: int, accum: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, on the concatenated (global) batch: the loss of each
    micro-step is the mean over the global batch of the squared error, divided by
    ``accum`` (so gradients are the global mean over the window)."""
    model = build_model(0)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    for window in make_data(steps, accum):
        opt.zero_grad()
        for x, y in window:
            loss = ((model(x) - y) ** 2).sum() / (GLOBAL_BATCH * accum)
            loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    rank: int
    popen: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def launch(
    scenario: str,
    out: Path,
    world: int = 2,
    timeout_s: float = 10.0,
    extra_env: dict[str, str] | None = None,
    worker: Path = WORKER,
) -> list[Proc]:
    """Start ``world`` worker processes (``worker SCENARIO OUT``) on 127.0.0.1, one per
    "node", with the hand-written launch environment (``NODE_RANK``, ``WORLD_SIZE``,
    ``MASTER_*``)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
            env.pop(k, None)
        env.update(
            {
                "NODE_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "ROUNDPIPE_DIST_TIMEOUT": str(timeout_s),
                "OMP_NUM_THREADS": "1",
                "PYTHONFAULTHANDLER": "1",  # a crash prints every thread's stack
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            }
        )
        env.update(extra_env or {})
        log = out / f"rank{rank}.log"
        with open(log, "w") as fh:
            popen = subprocess.Popen(
                [sys.executable, str(worker), scenario, str(out)],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
            )
        procs.append(Proc(rank, popen, log))
    return procs


def wait_all(procs: list[Proc], deadline_s: float) -> list[int | None]:
    """Wait for every process until ``deadline_s`` from now; kill the ones still
    running (a hang must fail the test, never block it). Returns exit codes
    (``None`` for a process that had to be killed)."""
    end = time.monotonic() + deadline_s
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.popen.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait(5)
    return codes
