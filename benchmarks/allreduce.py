"""All-reduce cost as a share of the step time, data-parallel RoundPipe on 2 processes.

Each process ("node") trains a small transformer-ish ``nn.Sequential`` (embedding,
pre-LN attention + MLP blocks, head) with RoundPipe on its CPU workers, and the
master gradients are all-reduced over gloo on 127.0.0.1. Three modes run side by
side in the same processes, interleaved round by round:

* ``local``   -- no all-reduce (each rank on its own): the compute baseline;
* ``sync``    -- ``GradientAllReducer(overlap=False)``: reduce after the backward;
* ``overlap`` -- ``arm()`` before ``forward_backward``: buckets start reducing from
  the grad hook while earlier stages still run their backward.

Reported per mode: step time, its overhead over ``local`` as a share of the step,
and the time ``finish()`` blocked the training loop (the exposed communication),
also as a share of the step.

Command (what the README quotes)::

    python benchmarks/allreduce.py                      # 2 processes, 2 CPU workers each
    python benchmarks/allreduce.py --dim 384 --layers 6 --steps 6 --rounds 3

Numbers on a shared 2-core CI box are noisy (both processes and their workers
compete for the same cores, so compute slows down while gloo moves bytes); on
real nodes the network is separate from the compute and the overlap hides more.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
MODES = ("local", "sync", "overlap")


class Block(nn.Module):
    """Pre-LayerNorm self-attention + MLP block (batch first)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def build_model(vocab: int, dim: int, layers: int, heads: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(vocab, dim), *[Block(dim, heads) for _ in range(layers)], Head(dim, vocab)
    )


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def worker(args: argparse.Namespace) -> None:
    from roundpipe_core import RoundPipe, RoundPipeRunConfig
    from roundpipe_lightning import distributed as D

    torch.set_num_threads(args.threads)
    D.init_process_group(timeout=120)
    rank = torch.distributed.get_rank()
    rp = RoundPipe(
        build_model(args.vocab, args.dim, args.layers, args.heads),
        devices=f"cpu:{args.devices}",
        model_run_config=RoundPipeRunConfig(num_microbatch=args.devices + 1),
    )
    D.broadcast_masters(rp)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4)
    reducers = {
        "sync": D.GradientAllReducer(rp, overlap=False, bucket_bytes=args.bucket_mb << 20),
        "overlap": D.GradientAllReducer(rp, overlap=True, bucket_bytes=args.bucket_mb << 20),
    }
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    exposed: dict[str, list[float]] = {m: [] for m in MODES}

    def step(mode: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        reducer = reducers.get(mode)
        if mode == "overlap":
            reducer.arm()
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        wait = 0.0
        if reducer is not None:
            reducer.finish()
            wait = reducer.last_finish_wait_s
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        rp.synchronize()  # count the optimizer in every mode alike
        return time.perf_counter() - t0, wait

    for mode in MODES:  # warm-up (timer, allocator, gloo connections)
        step(mode)
    for _ in range(args.rounds):
        for mode in MODES:
            D.barrier()  # start each mode's window together on both ranks
            for _ in range(args.steps):
                t, w = step(mode)
                times[mode].append(t)
                exposed[mode].append(w)
    # raw all-reduce of the same gradient bytes, nothing else running
    flat = torch.zeros(sum(p.numel() for p in rp.optim_parameters()))
    raw = []
    for _ in range(3):
        D.barrier()
        t0 = time.perf_counter()
        torch.distributed.all_reduce(flat)
        raw.append(time.perf_counter() - t0)
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "times": times,
                    "exposed": exposed,
                    "raw": raw,
                    "params": flat.numel(),
                    "buckets": len(reducers["overlap"].buckets),
                }
            )
        )
    for r in reducers.values():
        r.close()
    rp.close()
    D.barrier()
    D.destroy_process_group()


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def launch(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        procs = []
        for rank in range(args.world):
            env = dict(
                os.environ,
                NODE_RANK=str(rank),
                WORLD_SIZE=str(args.world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(args.threads),
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            )
            env.pop("RANK", None)
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", "--out", str(out), *sys.argv[1:]],
                    env=env,
                )
            )
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise SystemExit(f"benchmark processes exited with {codes}")
        res = json.loads(out.read_text())
    t = {m: _median(res["times"][m]) for m in MODES}
    w = {m: _median(res["exposed"][m]) for m in MODES}
    mb = res["params"] * 4 / 2**20
    print(
        f"\nmodel: dim={args.dim} layers={args.layers} seq={args.seq} batch/rank={args.batch} "
        f"params={res['params'] / 1e6:.2f}M (grads {mb:.1f} MiB, {res['buckets']} buckets of <= {args.bucket_mb} MiB)"
    )
    print(
        f"{args.world} processes x {args.devices} CPU workers, gloo on 127.0.0.1; "
        f"median of {args.rounds}x{args.steps} steps per mode"
    )
    print(
        f"raw all-reduce of all gradients (nothing else running): {_median(res['raw']) * 1e3:.1f} ms\n"
    )
    print(
        f"{'mode':<9}{'step ms':>9}{'vs local':>10}{'overhead share':>16}{'finish() blocked ms':>21}"
        f"{'blocked share':>15}"
    )
    for m in MODES:
        share = (t[m] - t["local"]) / t[m] if m != "local" else 0.0
        print(
            f"{m:<9}{t[m] * 1e3:>9.1f}{t[m] / t['local']:>10.3f}{share * 100:>15.1f}%{w[m] * 1e3:>21.1f}"
            f"{w[m] / t[m] * 100:>14.1f}%"
        )
    print(
        "\noverhead share: (step - local step) / step. blocked share: time the loop waited in finish() / step "
        "(the all-reduce not hidden behind compute; less noisy on a shared machine)."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="processes (nodes)")
    p.add_argument("--devices", type=int, default=2, help="CPU workers per process")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=6, help="sequences per rank and step")
    p.add_argument("--bucket-mb", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="steps per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
