"""CPU optimizer step time: ``roundpipe_core.optim`` against plain torch defaults.

    python benchmarks/optimizers.py [--params 20e6] [--rounds 7] [--only Adam,SGD]
                                     [--variants] [--threads N]

For each optimizer, one process builds the same parameters (fp32, in tensors shaped
like a small transformer: square matrices, a wide one, and vectors; 20M elements by
default) with the same random gradients for every contender:

- ``torch``: ``torch.optim.<Name>(params)`` with torch's defaults (on CPU that is the
  per-tensor loop: torch only picks foreach/fused by itself on accelerators);
- ``roundpipe``: ``roundpipe_core.optim.<Name>(params)`` (fused or foreach, see
  ``roundpipe_core/optim.py``);
- with ``--variants``: also ``loop`` / ``foreach`` / ``fused`` explicitly, the numbers
  the implementation table in ``roundpipe_core/optim.py`` was chosen from.

After one warm-up step each, the contenders step in turn, round by round (A, B, A, B,
...), so machine noise hits all alike. Each step is timed twice: wall clock, and the
CPU time of this process (all its threads), which other processes' load on a shared
machine disturbs far less. The table gives, per contender, the median and the spread
(min-max over rounds) of both, and the ratio of medians torch / contender (above 1:
faster than torch's default).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from roundpipe_core import optim as rp_optim

# the optimizer classes of roundpipe_core.optim (its helpers start lower-case)
NAMES = [n for n in rp_optim.__all__ if n[0].isupper()]
FUSED = {"Adam", "AdamW", "SGD", "Adagrad"}


def shapes(total: float) -> list[tuple[int, ...]]:
    """Transformer-like tensor shapes adding up to about ``total`` elements."""
    d = 1024
    out: list[tuple[int, ...]] = [(4 * d, d)]
    while sum(torch.Size(s).numel() for s in out) + d * d + d <= total:
        out += [(d, d), (d,)]
    return out


def make_params(shape_list: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for s in shape_list:
        p = torch.nn.Parameter(torch.randn(s, generator=g))
        p.grad = torch.randn(s, generator=g) * 1e-2
        params.append(p)
    return params


def contenders(name: str, variants: bool) -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    torch_cls = getattr(torch.optim, name)
    kw = {"momentum": 0.9} if name == "SGD" else {}
    out: dict[str, Callable[[list], torch.optim.Optimizer]] = {
        "torch": lambda ps: torch_cls(ps, **kw),
        "roundpipe": lambda ps: getattr(rp_optim, name)(ps, **kw),
    }
    if variants:
        out["loop"] = lambda ps: torch_cls(ps, foreach=False, **kw)
        out["foreach"] = lambda ps: torch_cls(ps, foreach=True, **kw)
        if name in FUSED:
            out["fused"] = lambda ps: torch_cls(ps, fused=True, **kw)
    return out


def bench(
    name: str, shape_list: list, rounds: int, variants: bool
) -> dict[str, tuple[list[float], list[float]]]:
    """Per contender: (wall seconds, CPU seconds) of each round's step."""
    opts = {k: make(make_params(shape_list)) for k, make in contenders(name, variants).items()}
    for opt in opts.values():
        opt.step()  # warm-up: allocates the state
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in opts}
    for _ in range(rounds):
        for k, opt in opts.items():
            c0, t0 = time.process_time(), time.perf_counter()
            opt.step()
            times[k][0].append(time.perf_counter() - t0)
            times[k][1].append(time.process_time() - c0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", type=str, default="")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.only.split(",") if n] or NAMES
    shape_list = shapes(args.params)
    n = sum(torch.Size(s).numel() for s in shape_list)
    print(
        f"{n / 1e6:.1f}M fp32 params in {len(shape_list)} tensors, {args.rounds} rounds, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        f"{'optimizer':10} {'contender':10} {'impl':8} {'wall ms':>8} {'spread':>11} "
        f"{'torch/x':>7} {'cpu ms':>8} {'spread':>11} {'torch/x':>7}"
    )
    for name in names:
        times = bench(name, shape_list, args.rounds, args.variants)
        base = [statistics.median(t) for t in times["torch"]]
        for k, per in times.items():
            impl = rp_optim.fastest_impl(name) if k == "roundpipe" else k
            cols = []
            for ts, b in zip(per, base):
                med = statistics.median(ts)
                spread = f"{min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f}"
                cols.append(f"{med * 1e3:8.0f} {spread:>11} {b / med:7.2f}")
            print(f"{name:10} {k:10} {impl:8} " + " ".join(cols), flush=True)


if __name__ == "__main__":
    main()
