"""The engine's fixed cost per job and per layer-microbatch, with compute negligible.

    python benchmarks/engine_overhead.py [--layers 16 64 256] [--microbatches 1 4 16]
                                         [--layers-per-stage 4] [--rounds 10]

A stack of tiny layers (``Linear(8, 8)``, a few rows per microbatch) so that
almost all of a call's time is bookkeeping. For every (layers, microbatches) cell,
one training call ``forward_backward()`` of RoundPipe on one CPU worker
(``torch.set_num_threads(1)``, uniform stages of ``--layers-per-stage`` layers) runs
against plain PyTorch doing the same microbatches: forward, loss and backward per
microbatch, gradients accumulated (the same arithmetic except RoundPipe's
recompute, one tiny extra forward per layer-microbatch outside the fused stage,
which is counted as overhead here). Every cell's two variants are interleaved
round by round with all other cells.

Printed per cell, on two clocks measured in the same runs: median ms of each side,
the engine overhead (RoundPipe - plain, per round, median and interquartile
spread) divided by the call's jobs and by layers x microbatches; then a
least-squares split of all cells' overhead into ``a`` ms per job + ``b`` ms per
layer-microbatch + ``c`` ms per call, fitted to the cells' medians and, for its
spread, to each round on its own. The wall clock is what a user waits for;
the process CPU time (all threads of this process) is what the engine costs
when other processes share the cores, as on a busy CI box.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.planning.schedule import build_schedule

WIDTH = 8
ROWS_PER_MICROBATCH = 2


def build(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 4:  # too few for quartiles: the full range instead
        return statistics.median(values), min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), q[0], q[2]


def measure(
    variants: dict[str, Callable[[], None]], rounds: int, warmup: int = 2
) -> dict[str, dict[str, list[float]]]:
    """Per-round seconds of every variant on two clocks, interleaved as in
    ``_interleave.interleave`` (the order rotates each round): ``"wall"``
    (perf_counter) and ``"cpu"`` (process_time: every thread of this process,
    the worker's included, but not other processes)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    out: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            w0, c0 = time.perf_counter(), time.process_time()
            variants[name]()
            c1, w1 = time.process_time(), time.perf_counter()
            out[name]["wall"].append(w1 - w0)
            out[name]["cpu"].append(c1 - c0)
    return out


def _split(jobs: list[float], layer_mbs: list[float], over: list[float]) -> list[float]:
    """Least squares ``over ~ a * jobs + b * layer_mbs + c``: ``[a, b, c]`` in ms."""
    a_mat = torch.tensor([[j, lm, 1.0] for j, lm in zip(jobs, layer_mbs)], dtype=torch.float64)
    b_vec = torch.tensor([[o] for o in over], dtype=torch.float64)
    return torch.linalg.lstsq(a_mat, b_vec).solution.flatten().tolist()


class Cell:
    """One (layers, microbatches) pair: a RoundPipe call and its plain counterpart."""

    def __init__(self, layers: int, mbs: int, per_stage: int) -> None:
        self.layers, self.mbs = layers, mbs
        stages = max(1, -(-layers // per_stage))
        plan = ModelExecutePlan.uniform(layers, stages, "fused")
        self.jobs = len(build_schedule(plan, "fused", 1, mbs))
        self.x = torch.randn(mbs * ROWS_PER_MICROBATCH, WIDTH)
        self.y = torch.randn(mbs * ROWS_PER_MICROBATCH, WIDTH)
        self.rp = RoundPipe(
            build(layers),
            devices="cpu:1",
            optim_dtype=torch.float32,
            model_run_config=RoundPipeRunConfig(num_microbatch=mbs, execute_plan=plan),
        )
        self.masters = list(self.rp.optim_parameters())
        self.plain = build(layers)
        self.xs = self.x.chunk(mbs)
        self.ys = self.y.chunk(mbs)

    def run_roundpipe(self) -> None:
        self.rp.forward_backward((self.x,), label=self.y, loss_fn=loss_fn)
        for p in self.masters:  # each call starts from empty gradients, as plain does
            p.grad = None

    def run_plain(self) -> None:
        for x, y in zip(self.xs, self.ys):
            loss_fn(self.plain(x), y).backward()
        self.plain.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers-per-stage", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    if args.layers_per_stage < 1:
        ap.error(f"--layers-per-stage must be >= 1, got {args.layers_per_stage}")
    torch.set_num_threads(args.threads)

    cells = [Cell(n, m, args.layers_per_stage) for n in args.layers for m in args.microbatches]
    variants = {}
    for c in cells:
        variants[f"rp {c.layers}x{c.mbs}"] = c.run_roundpipe
        variants[f"plain {c.layers}x{c.mbs}"] = c.run_plain
    try:
        timings = measure(variants, rounds=args.rounds, warmup=2)
    finally:
        for c in cells:
            c.rp.close()

    print(
        f"tiny layers Linear({WIDTH}, {WIDTH}), {ROWS_PER_MICROBATCH} rows per microbatch, "
        f"{args.layers_per_stage} layers per stage, 1 CPU worker, torch threads "
        f"{torch.get_num_threads()}, {args.rounds} interleaved rounds; overhead = RoundPipe - "
        "plain per round: median [p25..p75]"
    )
    for clock, what in (
        ("wall", "wall clock (what a user waits for; inflated on a loaded machine)"),
        ("cpu", "process CPU time, all threads (insensitive to other processes' load)"),
    ):
        print(f"\n{what}")
        print(
            f"{'layers':>6} {'mbs':>4} {'jobs':>5} {'plain ms':>9} {'rp ms':>9} {'rp/plain':>9}"
            f" {'overhead ms':>22} {'ms / job':>20} {'ms / layer-mb':>22}"
        )
        rows: list[tuple[float, float, float]] = []  # (jobs, layer-mbs, overhead ms)
        per_round: list[list[float]] = []  # per cell, the overhead ms of every round
        for c in cells:
            rp = timings[f"rp {c.layers}x{c.mbs}"][clock]
            plain = timings[f"plain {c.layers}x{c.mbs}"][clock]
            over = [(a - b) * 1e3 for a, b in zip(rp, plain)]
            lm = c.layers * c.mbs
            o = _quartiles(over)
            per_job = _quartiles([v / c.jobs for v in over])
            per_lm = _quartiles([v / lm for v in over])
            rp_ms, plain_ms = statistics.median(rp) * 1e3, statistics.median(plain) * 1e3
            print(
                f"{c.layers:>6} {c.mbs:>4} {c.jobs:>5} {plain_ms:>9.2f} {rp_ms:>9.2f} "
                f"{rp_ms / plain_ms:>9.2f} {f'{o[0]:.2f} [{o[1]:.2f}..{o[2]:.2f}]':>22}"
                f" {f'{per_job[0]:.3f} [{per_job[1]:.3f}..{per_job[2]:.3f}]':>20}"
                f" {f'{per_lm[0]:.4f} [{per_lm[1]:.4f}..{per_lm[2]:.4f}]':>22}"
            )
            rows.append((float(c.jobs), float(lm), o[0]))
            per_round.append(over)
        if len(rows) >= 3:
            coef = _split([j for j, _, _ in rows], [lm for _, lm, _ in rows], [o for *_, o in rows])
            print(
                f"least squares over the cells' median overheads: {coef[0]:.3f} ms per job + "
                f"{coef[1]:.4f} ms per layer-microbatch + {coef[2]:.2f} ms per call"
            )
            # the same split of each round on its own: how far one round's load moves it
            fits = [
                _split([j for j, _, _ in rows], [lm for _, lm, _ in rows], list(r))
                for r in zip(*per_round)
            ]
            q = [_quartiles([f[k] for f in fits]) for k in range(3)]
            print(
                f"  the split of each round, median [p25..p75]: {q[0][0]:.3f} "
                f"[{q[0][1]:.3f}..{q[0][2]:.3f}] ms per job, {q[1][0]:.4f} "
                f"[{q[1][1]:.4f}..{q[1][2]:.4f}] ms per layer-microbatch"
            )


if __name__ == "__main__":
    main()
