"""``Trainer(strategy=RoundPipeStrategy(async_step=True), num_nodes=2,
accumulate_grad_batches=2)`` as two processes on 127.0.0.1 (one per "node", gloo, 2
CPU workers each), launched through the environment; the reference is the same
LightningModule with ``RoundPipeStrategy`` in one process on the whole batch.

* Both nodes end identical, and equal (1e-5 relative) to the one-process run -- with
  the asynchronous (one step stale) optimizer step and gradient accumulation.
* ``self.log(..., sync_dist=True)`` gives the global mean loss on every node.
* The host-memory budget the strategy prints counts the reduction's kept flat buffers.
* Rank 0 writes the checkpoint; every node resumes from it in a second
  ``Trainer.fit`` of the same process (process group reused) and matches the
  one-process resume.
* Then overlapped iterations (no hook reads the gradients): the calls are issued
  non-blocking on every node too, the reduction runs in front of each queued step, and
  the weights match the one-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, free_port, rel_err  # noqa: E402

LIT_WORKER = Path(__file__).with_name("_lit_worker.py")
DEADLINE_S = 150.0  # start-up (torch + Lightning imports on a loaded 2-core box) + the run


def _launch(out: Path, worker: Path = LIT_WORKER) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "GROUP_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NAME")
        }
        env.update(
            {
                "NODE_RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONFAULTHANDLER": "1",  # a crash prints every thread's stack
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            }
        )
        with open(out / f"rank{rank}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), str(out)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(ROOT),
                )
            )
    return procs


def _wait(procs: list[subprocess.Popen], deadline_s: float) -> list[int | None]:
    end = time.monotonic() + deadline_s
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    return codes


def _logs(out: Path) -> str:
    return "\n".join(
        f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text(errors='replace')[-4000:]}"
        for r in range(2)
        if (out / f"rank{r}.log").exists()
    )


@pytest.mark.timeout(DEADLINE_S + 90)
def test_two_nodes_async_accumulate_log_resume_and_overlap_like_one_process(
    tmp_path: Path,
) -> None:
    from _lit_worker import GLOBAL_BATCH, RESUMED_STEPS, dataset, run, run_overlapped
    from torch.utils.data import DataLoader

    out = tmp_path / "nodes"
    out.mkdir()
    procs = _launch(out)
    try:
        whole_batch = DataLoader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
        ref = run(whole_batch, 1, tmp_path / "ref.ckpt")
        ref_overlapped = run_overlapped(whole_batch, 1)
        codes = _wait(procs, DEADLINE_S)
    finally:
        _wait(procs, 0.1)
    assert codes == [0, 0], f"nodes exited with {codes} (None = hung and killed)\n{_logs(out)}"

    infos = [json.loads((out / f"info_rank{r}.json").read_text()) for r in range(2)]
    params = [torch.load(out / f"params_rank{r}.pt") for r in range(2)]
    assert [(i["world"], i["rank"]) for i in infos] == [(2, 0), (2, 1)]
    for r in range(2):
        assert infos[r]["step"] == RESUMED_STEPS == ref["step"]
        assert abs(infos[r]["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (
            f"rank {r} logged {infos[r]['loss']} with sync_dist, the global mean is {ref['loss']}"
        )
    for phase in ("first", "resumed"):
        for k, want in ref[phase].items():
            got0, got1 = params[0][phase][k], params[1][phase][k]
            assert torch.equal(got0, got1), f"{phase}: {k} differs between the nodes"
            assert rel_err(got0, want) <= 1e-5, (
                f"{phase}: {k} rel err {rel_err(got0, want):.2e} vs one process"
            )
    # not vacuous: the resumed run trained further
    assert any(not torch.equal(ref["first"][k], ref["resumed"][k]) for k in ref["first"])
    # on_before_optimizer_step reads the module's gradients reduced over the nodes (DDP's)
    for r in range(2):
        for k, want in ref["first_grads"].items():
            err = rel_err(params[r]["first_grads"][k], want)
            assert err <= 1e-5, f"rank {r}: the hook saw {k}'s gradient at rel err {err:.2e}"
    # the host-memory budget the strategy checks (and prints) counts what the unsharded
    # reduction keeps on each node: its ring of flat buffers
    from _lit_worker import Lit

    from roundpipe_core.distributed import reduce_buffer_bytes
    from roundpipe_core.planning.profile import format_bytes

    ring = reduce_buffer_bytes(Lit().parameters(), world_size=2)
    lines = (out / "rank0.log").read_text(errors="replace").splitlines()
    budget = [line for line in lines if line.strip().startswith("collective buffers")]
    assert ring > 0 and budget, _logs(out)
    assert all(line.split()[2:4] == format_bytes(ring).split() for line in budget), (budget, ring)
    _check_overlapped(out, ref_overlapped)


def _check_overlapped(out: Path, ref: dict) -> None:
    """The fit no hook of which reads the gradients: its iterations overlapped on every
    node as in one process (the reduction in front of each queued step), same weights."""
    from _lit_worker import ACCUM, RESUMED_STEPS, Lit

    nodes = [torch.load(out / f"overlapped_rank{r}.pt") for r in range(2)]
    # every call after the first (which learns the loss's shape) was issued non-blocking
    calls = RESUMED_STEPS * ACCUM
    assert ref["lazy_losses"] == calls - 1
    assert [n["lazy_losses"] for n in nodes] == [calls - 1] * 2, _logs(out)
    for k, want in ref["params"].items():
        got0, got1 = nodes[0]["params"][k], nodes[1]["params"][k]
        assert torch.equal(got0, got1), f"overlapped: {k} differs between the nodes"
        err = rel_err(got0, want)
        assert err <= 1e-5, f"overlapped: {k} rel err {err:.2e} vs one process"
    # not vacuous: the run trained
    assert any(not torch.equal(v, ref["params"][k]) for k, v in Lit().net.state_dict().items())
