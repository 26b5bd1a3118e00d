"""The engine's Python work per training call, counted in bytecodes rather than timed.

    python benchmarks/engine_bytecodes.py [--layers 64 256] [--microbatches 1 4]
                                          [--calls 3] [--top 15]

``engine_overhead.py`` times the engine's fixed cost per job. On a shared VM whose
speed drifts by tens of percent from one run to the next, a few microseconds per job
are lost in that noise. This script counts the work instead. It counts every Python
bytecode run during one ``forward_backward()`` of ``engine_overhead``'s cells (tiny
``Linear(8, 8)`` layers, one CPU worker), on every thread (the caller, the worker, the
optimizer thread), by function, through ``sys.settrace`` opcode events.

The count repeats from run to run of the same tree (a wait that times out under load
would loop once more; none did in our runs), so two trees compare exactly: run the
script from each one, with that tree on ``PYTHONPATH``. It does not see work done
in C: PyTorch's kernels and dispatcher, builtins, lock waits. Check separately that the
compared trees run the same operators, for example by counting the profiler's events
with ``profile_all_threads``. Tracing makes a call some 20 times slower: the figures
are counts, not times.

Printed per cell: the bytecodes per call and per job, then the functions that ran the
most (``file:function``, bytecodes per call).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import Cell  # noqa: E402

_counts: Counter[Any] = Counter()
_counting = False


def _opcodes(frame: FrameType, event: str, arg: Any) -> Any:
    if _counting and event == "opcode":
        _counts[frame.f_code] += 1
    return _opcodes


def _on_call(frame: FrameType, event: str, arg: Any) -> Any:
    """The trace function of every thread: frames entered while counting are traced."""
    if not _counting:
        return None
    frame.f_trace_opcodes = True
    return _opcodes


def _trace_running_frames() -> None:
    """Trace the frames already on every thread's stack too (a worker's loop)."""
    for frame in sys._current_frames().values():
        f: FrameType | None = frame
        while f is not None:
            f.f_trace = _opcodes
            f.f_trace_opcodes = True
            f = f.f_back


def _where(code: Any) -> str:
    path = Path(code.co_filename)
    parts = path.parts
    for root in ("roundpipe_core", "roundpipe_lightning", "torch"):
        if root in parts:
            path = Path(*parts[parts.index(root) :])
            break
    else:
        path = Path(path.name)
    return f"{path}:{code.co_name}"


def count(cell: Cell, calls: int) -> Counter[Any]:
    """Bytecodes per function over ``calls`` training calls of ``cell``."""
    global _counting
    _counts.clear()
    _counting = True
    _trace_running_frames()
    try:
        for _ in range(calls):
            cell.run_roundpipe()
    finally:
        _counting = False
    return Counter(_counts)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layers-per-stage", type=int, default=4)
    ap.add_argument("--calls", type=int, default=3, help="traced calls per cell")
    ap.add_argument("--top", type=int, default=15, help="functions listed per cell")
    args = ap.parse_args()
    if args.calls < 1 or args.layers_per_stage < 1:
        ap.error("--calls and --layers-per-stage must be >= 1")
    torch.set_num_threads(1)
    # before the cells start their threads: each new thread calls _on_call
    threading.settrace(_on_call)
    sys.settrace(_on_call)
    print(
        f"Python bytecodes per forward_backward() of Linear(8, 8) layers, "
        f"{args.layers_per_stage} layers per stage, 1 CPU worker, all threads"
    )
    for layers in args.layers:
        for mbs in args.microbatches:
            cell = Cell(layers, mbs, args.layers_per_stage)
            try:
                for _ in range(3):  # warm-up: the first calls plan and allocate
                    cell.run_roundpipe()
                counts = count(cell, args.calls)
            finally:
                cell.rp.close()
            total = sum(counts.values()) / args.calls
            print(
                f"\n{layers} layers x {mbs} microbatches, {cell.jobs} jobs: "
                f"{total:,.0f} bytecodes per call, {total / cell.jobs:,.0f} per job"
            )
            for code, n in counts.most_common(args.top):
                print(f"  {n / args.calls:>10,.0f}  {_where(code)}")
    sys.settrace(None)
    threading.settrace(None)


if __name__ == "__main__":
    main()
