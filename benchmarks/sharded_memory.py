"""Per-rank host memory of data-parallel RoundPipe with ``shard_host_state=True`` (or,
``--unsharded``, plain ``DataParallel()``), for N = 1, 2, 4 ranks on this machine (gloo
over 127.0.0.1), against the host-memory budget.

Each rank is a fresh process (``--child``) that trains the same model (fp32, AdamW,
2 CPU workers, shared masters: the synchronous CPU default; with ``--bf16`` a bf16
model with separate fp32 masters, sharded too; with ``--async-step`` separate fp32
masters -- bf16 weights too with ``--bf16`` -- sharded, stepping asynchronously:
``attach(..., async_step=True)``, ``step(is_async=True)``) for a few steps through
``DataParallel(shard_host_state=True, bucket_bytes=--bucket-mb)`` and reports:

* ``peak``: the whole process's peak RSS (``VmHWM``: interpreter and torch included);
* ``predicted``: the budget's whole-process prediction,
  ``estimate_host_memory(rp, optimizer=[opt], state_shards=N, collective_buffers=
  dp.kept_buffer_bytes(rp, [opt])).process_peak`` (the state lines, the collectives'
  kept buffers, plus the process's resident set beyond its state at the estimate);
* ``kept``: the bytes of the flat buffers the collectives hold after the last step
  (the reducers' rings and, sharded, the all-gather's), against ``buffers``, the
  budget's "collective buffers" line;
* ``state``: the optimizer-state bytes the rank holds (``D.state_bytes``), and
  ``masters``: the bytes of the separate masters it holds values for (0 when shared);
* ``step ms``: the median wall time of a training step after the first (backward,
  reduction, step, all-gather), and its ratio to the glibc-default run of the same N
  -- what the fixed mmap threshold costs (one process per variant, the variants run
  one after the other for each N: a rough ratio on a shared machine).

Each N runs with four variants, one after the other: ``glibc`` (glibc's default
``malloc``, nothing set: what a user gets), ``per-step`` (glibc's default, but the
reduction's and the all-gather's flat buffers made and freed at every bucket of every
step, as before they were kept: the child swaps them back in), ``roundpipe`` (the child
calls :func:`roundpipe_core.running.host_memory.limit_heap_retention` first) and ``env``
(``MALLOC_MMAP_THRESHOLD_=65536`` at launch). With glibc's default threshold, the first
``free`` of a large block raises the threshold to that block's size (up to 32 MiB): a
25 MiB bucket made and freed every step lifts it above every gradient, whose freed
blocks then stay in the heaps, and the peak RSS crept up to 1.3-1.4x the prediction.
With a fixed threshold every large tensor is its own mapping, returned to the system
when freed -- at the price of page faults on every one.

Run once (Linux; ~2.5 GB of RAM for N = 4; about two minutes on 2 cores):

    python benchmarks/sharded_memory.py --steps 6       # width 512, 8 blocks (~17M params)
    python benchmarks/sharded_memory.py --width 256     # quicker
    python benchmarks/sharded_memory.py --worlds 2,4 --variants glibc,per-step
    python benchmarks/sharded_memory.py --unsharded --variants glibc,env --bucket-mb 4
    python benchmarks/sharded_memory.py --async-step --variants glibc,env
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_LIMIT_HEAP = "SHARDED_MEMORY_LIMIT_HEAP"  # this benchmark's switches for its child processes
_PER_STEP = "SHARDED_MEMORY_PER_STEP_BUFFERS"


def _per_step_buffers() -> None:
    """The collectives' flat buffers as they were before they were kept: made for every
    bucket of every step and freed once it has landed (the comparison's "before")."""
    import torch

    from roundpipe_core.distributed import buckets, sharded

    def fresh(self: Any, bucket: list) -> Any:
        return torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype)

    def fresh_slot(self: Any, bucket: Any) -> Any:
        return torch.empty(bucket.flat_numel, dtype=bucket.dtype)  # dropped once it landed

    buckets.BufferRing.slot = fresh_slot  # type: ignore[method-assign]
    sharded.HostShard._flat_for = fresh  # type: ignore[method-assign]


def _kept_bytes(dp: Any) -> int:
    """Bytes of the flat buffers ``dp``'s collectives hold now (a reducer from before the
    ring kept one per bucket, ``_Bucket.buffer``: counted too, for a "before" run)."""
    total = 0
    for reducer in dp._reducers.values():
        if hasattr(reducer, "kept_buffers"):
            total += sum(t.untyped_storage().nbytes() for t in reducer.kept_buffers())
        else:
            held = [getattr(b, "buffer", None) for b in reducer.buckets]
            held += [t for ts in getattr(reducer, "_slots", {}).values() for t in ts]
            total += sum(t.untyped_storage().nbytes() for t in held if t is not None)
    for shard in dp._shards.values():
        total += sum(t.untyped_storage().nbytes() for t in shard._gather_flat.values())
    return total


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _build(width: int, blocks: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks)
        ]
    )


def child(
    width: int,
    blocks: int,
    steps: int,
    bf16: bool,
    sharded: bool,
    bucket_bytes: int,
    is_async: bool = False,
) -> dict[str, Any]:
    import torch

    import roundpipe_core.distributed as D
    from roundpipe_core import RoundPipe, RoundPipeRunConfig
    from roundpipe_core.running.host_memory import estimate_host_memory

    torch.set_num_threads(1)
    if os.environ.get(_LIMIT_HEAP):
        from roundpipe_core.running.host_memory import limit_heap_retention

        limit_heap_retention()
    if os.environ.get(_PER_STEP):
        _per_step_buffers()
    D.init_process_group() if int(os.environ["WORLD_SIZE"]) > 1 else None
    world = D.DataParallel().world_size
    rank = torch.distributed.get_rank() if world > 1 else 0
    base = _status("VmRSS")
    dtype = torch.bfloat16 if bf16 else torch.float32
    rp = RoundPipe(
        _build(width, blocks).to(dtype),
        optim_dtype=torch.float32,
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
        shared_masters=not (bf16 or is_async),
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4)
    dp = D.DataParallel(shard_host_state=sharded, bucket_bytes=bucket_bytes)
    dp.attach(rp, [opt], async_step=is_async)
    budget = estimate_host_memory(
        rp,
        optimizer=[opt],
        num_microbatch=3,
        async_step=is_async,  # as the loop below steps
        state_shards=dp.state_shards,
        collective_buffers=dp.kept_buffer_bytes(rp, [opt]),
    )
    predicted = budget.process_peak
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(12, width, generator=g).to(dtype), torch.randn(12, width, generator=g)
    step_s: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dp.wrap_closure(
            opt,
            lambda: rp.forward_backward(
                input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean()
            ),
        )()
        dp.reduce(opt)

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            dp.after_step(opt)

        rp.step(step, is_async=is_async)
        step_s.append(time.perf_counter() - t0)
    rp.synchronize()
    peak = _status("VmHWM")
    out = {
        "rank": rank,
        "world": world,
        "params": budget.num_params,
        "peak": peak,
        "run": peak - base,
        "predicted": predicted,
        "state_lines": budget.total,
        "buffers": budget.collective_buffers,
        "kept": _kept_bytes(dp),
        "state": D.state_bytes(opt),
        "masters": sum(m.untyped_storage().nbytes() for _, _, m in rp.masters.copies),
        "step_s": statistics.median(step_s[1:] or step_s),
    }
    dp.detach()
    rp.close()
    if world > 1:
        D.barrier()
        D.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what the ranks run with (see the module docstring)
MALLOC_VARIANTS: dict[str, dict[str, str]] = {
    "glibc": {},
    "per-step": {_PER_STEP: "1"},
    "roundpipe": {_LIMIT_HEAP: "1"},
    "env": {"MALLOC_MMAP_THRESHOLD_": "65536"},
}


def run_world(world: int, args: argparse.Namespace, malloc: dict[str, str]) -> list[dict[str, Any]]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        env.pop(_LIMIT_HEAP, None)
        env.pop(_PER_STEP, None)
        env.update(malloc)
        env.update(
            NODE_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        cmd = [sys.executable, __file__, "--child", "--width", str(args.width)]
        cmd += ["--blocks", str(args.blocks), "--steps", str(args.steps)]
        cmd += ["--bf16"] if args.bf16 else []
        cmd += ["--async-step"] if args.async_step else []
        cmd += ["--unsharded"] if args.unsharded else []
        cmd += ["--bucket-mb", str(args.bucket_mb)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"rank failed with {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="a bf16 model, fp32 masters (sharded)")
    ap.add_argument("--unsharded", action="store_true", help="DataParallel() instead")
    ap.add_argument(
        "--async-step", action="store_true", help="separate masters, asynchronous steps"
    )
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DataParallel(bucket_bytes)")
    ap.add_argument("--worlds", default="1,2,4", help="rank counts, comma-separated")
    ap.add_argument("--variants", default=",".join(MALLOC_VARIANTS), help="comma-separated")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        bucket_bytes = int(args.bucket_mb * 2**20)
        sharded = not args.unsharded
        result = child(
            args.width,
            args.blocks,
            args.steps,
            args.bf16,
            sharded,
            bucket_bytes,
            is_async=args.async_step,
        )
        print(json.dumps(result))
        return
    mib = 2**20
    print(
        f"{'malloc':>9} {'N':>2} {'rank':>4} {'peak RSS':>10} {'predicted':>10} "
        f"{'meas/pred':>9} {'run':>9} {'state lines':>11} {'buffers':>9} {'kept':>9} "
        f"{'opt state':>10} {'state/N=1':>9} "
        f"{'masters':>9} {'step ms':>8} {'vs glibc':>8}"
    )
    whole_state = None
    variants = {k: MALLOC_VARIANTS[k] for k in args.variants.split(",")}
    for world in (int(w) for w in args.worlds.split(",")):
        glibc_step = None
        for label, malloc in variants.items():  # interleaved: N, then each variant
            ranks = run_world(world, args, malloc)
            step = max(r["step_s"] for r in ranks)  # the job is as slow as its slowest rank
            glibc_step = glibc_step or step
            for r in ranks:
                whole_state = whole_state or r["state"]
                print(
                    f"{label:>9} {world:>2} {r['rank']:>4} {r['peak'] / mib:8.1f}Mi "
                    f"{r['predicted'] / mib:8.1f}Mi {r['peak'] / r['predicted']:9.3f} "
                    f"{r['run'] / mib:7.1f}Mi {r['state_lines'] / mib:9.1f}Mi "
                    f"{r['buffers'] / mib:7.1f}Mi {r['kept'] / mib:7.1f}Mi "
                    f"{r['state'] / mib:8.1f}Mi {r['state'] / whole_state:9.3f} "
                    f"{r['masters'] / mib:7.1f}Mi {step * 1e3:8.1f} {step / glibc_step:8.3f}"
                )
    print(
        f"({r['params']:,} parameters; 'run' = peak RSS minus the RSS before the model was "
        "built; 'state lines' = the budget's total without the process line, of which "
        f"{r['buffers'] / mib:.1f} MiB collective buffers at N={r['world']})"
    )


if __name__ == "__main__":
    main()
