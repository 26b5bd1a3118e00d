"""The disk tier (``RoundPipe(offload_dir=PATH)``): its step time against the same run in
RAM, and a model whose training state is several times a memory cap training inside it.

Speed (default): two RoundPipes of the same bf16 ``nn.Sequential`` of ``Linear`` layers,
one in RAM, one with ``offload_dir``, both stepping layer-wise (AdamW, fp32 masters) after
overlapped iterations (``forward_backward(blocking=False)``). Round by round, alternating
which goes first, each runs ``--steps`` iterations; printed: the median time per
iteration of each and its spread (min..max over rounds), their ratio (the bar: <= 1.3x),
the bytes the tier moved per step, the IO threads' busy time per step, and the share of
that IO hidden behind compute: ``1 - (t_tier - t_ram) / io_time`` (capped to [0, 1]).

Memory cap (``--cap``, as root, cgroup v1): a child process puts itself into a fresh
memory cgroup with ``memory.limit_in_bytes`` = ``--cap-gib`` before importing torch, then
trains a bf16 model with the tier; the kernel kills it if it goes over. Printed: the whole
training state (18 B/param: bf16 weights 2, fp32 masters 4, gradients 4, AdamW 8) against
the cap, the cgroup's peak usage (``memory.max_usage_in_bytes``, page cache included), and
the losses.

    python benchmarks/disk_tier.py --layers 16 --width 1024 --rounds 5
    python benchmarks/disk_tier.py --cap --layers 48 --width 2048 --cap-gib 1.2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

CGROUP_ROOT = "/sys/fs/cgroup/memory"


def _model(layers: int, width: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Linear(width, width, bias=False, dtype=torch.bfloat16) for _ in range(layers)]
    )


def _rp(
    layers: int,
    width: int,
    offload: str | None,
    devices: str,
    microbatches: int | None = None,
    stages: int = 0,
) -> Any:
    import torch

    from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

    plan = ModelExecutePlan.uniform(layers, stages, "fused") if stages else None

    return RoundPipe(
        _model(layers, width),
        optim_dtype=torch.float32,
        devices=devices,
        shared_masters=False,
        offload_dir=offload,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=microbatches, execute_plan=plan),
    )


def _loss(out: Any, y: Any) -> Any:
    return ((out.float() - y.float()) ** 2).mean()


def _iterate(rp: Any, opt: Any, batches: list, steps: int) -> float:
    """``steps`` overlapped iterations with layer-wise steps; seconds per iteration."""
    import functools

    from roundpipe_core.stepping.layerwise import step_subset

    step = functools.partial(step_subset, opt)
    t0 = time.perf_counter()
    pending = []
    for k in range(steps):
        x, y = batches[k % len(batches)]
        pending.append(rp.forward_backward((x,), label=y, loss_fn=_loss, blocking=False))
        rp.step_layerwise(step, finish=opt.zero_grad)
    losses = [float(p.result()) for p in pending]
    rp.synchronize()
    dt = (time.perf_counter() - t0) / steps
    assert all(v == v for v in losses), "NaN loss"
    return dt


def speed(args: argparse.Namespace) -> None:
    import torch

    holder = tempfile.TemporaryDirectory(prefix="rp-tier-bench-", dir=args.dir)
    store = holder.name
    rps = {"ram": _rp(args.layers, args.width, None, args.devices)}
    rps["disk"] = _rp(args.layers, args.width, store, args.devices)
    opts = {k: torch.optim.AdamW(rp.optim_parameters(), lr=1e-4) for k, rp in rps.items()}
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(args.tokens, args.width, generator=g).bfloat16(),
            torch.randn(args.tokens, args.width, generator=g).bfloat16(),
        )
        for _ in range(4)
    ]
    tier = rps["disk"].disk_tier
    for k in rps:  # warm-up: first steps create the state, fault pages in
        _iterate(rps[k], opts[k], batches, 2)
    times: dict[str, list[float]] = {"ram": [], "disk": []}
    moved: list[float] = []
    io: list[float] = []
    for r in range(args.rounds):
        order = ["ram", "disk"] if r % 2 == 0 else ["disk", "ram"]
        for k in order:
            b0, s0 = tier.bytes_read + tier.bytes_written, tier.io_seconds
            times[k].append(_iterate(rps[k], opts[k], batches, args.steps))
            if k == "disk":
                moved.append((tier.bytes_read + tier.bytes_written - b0) / args.steps)
                io.append((tier.io_seconds - s0) / args.steps)
        print(
            f"round {r}: ram {times['ram'][-1]:.3f} s, disk {times['disk'][-1]:.3f} s", flush=True
        )
    for rp in rps.values():
        rp.close()
    holder.cleanup()
    params = sum(p.numel() for p in rps["ram"].model.parameters())
    med = {k: statistics.median(v) for k, v in times.items()}
    io_med = statistics.median(io)
    hidden = 1.0 - (med["disk"] - med["ram"]) / io_med if io_med > 0 else 1.0
    out = {
        "params": params,
        "tokens_per_iteration": args.tokens,
        "direct_io": tier.direct,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "ram_s": {"median": med["ram"], "min": min(times["ram"]), "max": max(times["ram"])},
        "disk_s": {"median": med["disk"], "min": min(times["disk"]), "max": max(times["disk"])},
        "ratio": med["disk"] / med["ram"],
        "bytes_moved_per_step": statistics.median(moved),
        "io_busy_s_per_step": io_med,
        "io_hidden_share": max(0.0, min(1.0, hidden)),
        "load_avg": os.getloadavg(),
    }
    print(json.dumps(out, indent=1))


def make_memory_cgroup(cap: int, prefix: str = "roundpipe-tier") -> str:
    """A fresh cgroup-v1 memory cgroup capped at ``cap`` bytes, without swap (as root)."""
    if not os.path.isdir(CGROUP_ROOT):
        sys.exit(f"no cgroup v1 memory controller at {CGROUP_ROOT}")
    path = os.path.join(CGROUP_ROOT, f"{prefix}-{os.getpid()}")
    os.mkdir(path)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(cap))
    with open(os.path.join(path, "memory.swappiness"), "w") as f:
        f.write("0")
    return path


def cap_parent(args: argparse.Namespace) -> None:
    cap = int(args.cap_gib * 2**30)
    path = make_memory_cgroup(cap)
    cmd = [sys.executable, __file__, "--cap-child", path, *sys.argv[1:]]
    cmd.remove("--cap")
    try:
        # glibc's dynamic mmap threshold keeps freed buffers of up to 32 MiB in the heap
        # (measured: 830 vs 482 MB peak for 25M parameters); a fixed one returns them
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        peak = int(open(os.path.join(path, "memory.max_usage_in_bytes")).read())
        failcnt = int(open(os.path.join(path, "memory.failcnt")).read())
        oom = open(os.path.join(path, "memory.oom_control")).read()
    finally:
        try:
            os.rmdir(path)  # (empty: the child has exited)
        except OSError:
            pass
    print(proc.stdout.strip())
    if proc.returncode:
        print(proc.stderr[-3000:])
    params = args.layers * args.width * args.width
    state = 18 * params
    print(
        json.dumps(
            {
                "params": params,
                "training_state_bytes (18 B/param)": state,
                "cap_bytes": cap,
                "state_over_cap": state / cap,
                "cgroup_peak_usage_bytes": peak,
                "cgroup_failcnt": failcnt,
                "oom_control": oom.split(),
                "child_returncode": proc.returncode,
            },
            indent=1,
        )
    )


def cap_child(args: argparse.Namespace) -> None:
    # into the capped cgroup before torch is imported: everything it allocates counts
    with open(os.path.join(args.cap_child, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    import torch

    holder = tempfile.TemporaryDirectory(prefix="rp-tier-cap-", dir=args.dir)
    store = holder.name
    # one microbatch: a stage's gradients arrive once and stay bf16 until stepped (a
    # second microbatch's are summed in the masters' fp32)
    # many stages: a worker holds one small stage's gradients and recompute at a time
    rp = _rp(args.layers, args.width, store, args.devices, microbatches=1, stages=args.stages)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.width, generator=g).bfloat16()
    y = torch.randn(args.tokens, args.width, generator=g).bfloat16()
    import functools

    from roundpipe_core.stepping.layerwise import step_subset

    step = functools.partial(step_subset, opt)
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = rp.forward_backward((x,), label=y, loss_fn=_loss, blocking=False)
        # synchronous: no second iteration's gradients beside this step's (the least memory)
        rp.step_layerwise(step, finish=opt.zero_grad, is_async=False)
        losses.append(float(out.result()))
        print(f"step {len(losses)}: loss {losses[-1]:.6f}", file=sys.stderr, flush=True)
    rp.synchronize()
    tier = rp.disk_tier
    print(
        json.dumps(
            {
                "losses": losses,
                "s_per_step": (time.perf_counter() - t0) / args.steps,
                "tier_peak_resident_bytes": tier.peak_resident,
                "tier_disk_bytes": tier.disk_bytes,
                "direct_io": tier.direct,
            }
        )
    )
    rp.close()
    holder.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256, help="rows per iteration")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="iterations per round")
    ap.add_argument("--devices", default="cpu:2")
    ap.add_argument("--dir", default=None, help="where the store goes (default: the temp dir)")
    ap.add_argument("--cap", action="store_true", help="the memory-cap demonstration")
    ap.add_argument("--cap-gib", type=float, default=1.5)
    ap.add_argument("--stages", type=int, default=0, help="uniform stages (0: the default plan)")
    ap.add_argument("--cap-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cap_child:
        cap_child(args)
    elif args.cap:
        cap_parent(args)
    else:
        speed(args)


if __name__ == "__main__":
    main()
