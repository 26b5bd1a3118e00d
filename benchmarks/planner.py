"""Planner table: auto() plans of transformer-shaped profiles, simulated side by side.

Run::

    python benchmarks/planner.py            # the table (about 10 s on 2 cores)
    python benchmarks/planner.py --timeline qwen3-1.7b 8 9   # one case as ASCII timelines

Profiles (times per microbatch, normalised to one decoder layer's forward = 1.0;
backward = 2 x forward, recompute = forward; sizes in bf16):

* Qwen3-1.7B at 2K tokens: embedding, 28 equal decoder layers, final norm + LM
  head costing 5 x a layer's forward (151,936-word vocabulary);
* Llama-3.1-8B: embedding, 32 decoder layers, LM head 2 x a layer's forward.

For 1, 2, 4 and 8 devices and num_microbatch = devices + 1 (RoundPipe's
default) and 2 x devices, each row shows:

* ``stages``: stages of the ``ModelExecutePlan.auto("fused", ...)`` plan
  (forward + backward, the fused one included) and its layout;
* ``eff``: simulated efficiency of one iteration = busy / (devices x makespan);
* ``vs bound``: speedup over the weight-binding baseline the paper compares
  against — the same layers cut into ``devices`` stages balanced as well as
  possible, each bound to its device, 1F1B with activation recompute
  ``vs same``: over the auto plan's own backward stages bound to devices
  (stage i on device i mod N, GPipe order when there are more stages than devices);
* ``ceiling``: the best efficiency any schedule of this plan can reach, from the
  critical path of the slowest stage (every microbatch passes it one after
  another) and the work per device;
* ``greedy``: the published greedy planner's plan, its simulated efficiency, and
  our makespan relative to it (< 1 is faster); ``cost``: the published cost
  ``max(S, min_stages) x slowest stage`` of the exact search relative to the greedy one;
  (``OOM`` where a bound stage's bf16 weights and gradients exceed a 24 GB device);
* the notes below the table: the fastest any "fused" plan can be within one
  iteration (see ``single_iteration_floor``), as a speedup over the bound baseline;
* ``overlap``: efficiency and speedup over the bound baseline when the next
  iteration may start on free devices before this one's backward tail ends
  (allowed by the one-step-stale asynchronous update; the bound baseline
  flushes its pipeline every iteration), over 8 iterations. This is what
  ``forward_backward(blocking=False)`` runs: ``simulate(overlap_iterations=True)``
  models the engine's rules (round-robin continued across iterations, iteration
  k reads step k-2's weights, a layer's upload waits until iteration k-1 has
  uploaded it, prefetch only within an iteration).
* below the notes, for Qwen3-1.7B on 8 devices: the steady state (32
  iterations) and the effect of the host optimizer step's duration
  (``step_ms``, in the profile's units); steps run one after another on one
  thread and iteration k needs step k-2, so a step longer than an iteration
  becomes the pace.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from roundpipe_core.plan import ModelExecutePlan
from roundpipe_core.planner import search_plans
from roundpipe_core.profile import LayerProfile
from roundpipe_core.simulate import balanced_stages, simulate, simulate_bound_stages

GB = 1024**3


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int
    vocab: int
    head_ratio: float  # LM head forward / decoder layer forward

    def profile(self) -> LayerProfile:
        h = self.hidden
        layer_params = 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.intermediate
        table = self.vocab * h
        fwd = [0.02] + [1.0] * self.layers + [self.head_ratio]
        bwd = [0.1] + [2.0] * self.layers + [2.0 * self.head_ratio]
        params = [2 * table] + [2 * layer_params] * self.layers + [2 * (table + h)]
        return LayerProfile(fwd, bwd, re_ms=list(fwd), param_bytes=params)


SHAPES = {
    "qwen3-1.7b": Shape("Qwen3-1.7B", 28, 2048, 6144, 1024, 151936, 5.0),
    "llama-8b": Shape("Llama-3.1-8B", 32, 4096, 14336, 1024, 128256, 2.0),
}
DEVICE_MEMORY_GB = 24.0  # RTX 4090, the paper's GPU


def auto_plan(prof: LayerProfile, devices: int, mbs: int) -> ModelExecutePlan:
    plan = ModelExecutePlan.auto(
        "fused",
        prof,
        min_stages=devices,
        model_memory_limit=0.6 * DEVICE_MEMORY_GB,
        num_microbatch=mbs,
    )
    assert isinstance(plan, ModelExecutePlan)
    return plan


def stage_times(plan: ModelExecutePlan, prof: LayerProfile) -> list[float]:
    f, b, r = prof.fwd_ms, prof.bwd_ms, prof.re_ms or prof.fwd_ms
    out = [sum(f[i] for i in s) for s in plan.fwd_plan]
    out.append(sum(f[i] + b[i] for i in plan.bwd_plan[0]))
    out += [sum(r[i] + b[i] for i in s) for s in plan.bwd_plan[1:]]
    return out


def row(key: str, devices: int, mbs: int) -> dict:
    prof = SHAPES[key].profile()
    fwd, bwd, re = list(prof.fwd_ms), list(prof.bwd_ms), list(prof.re_ms or prof.fwd_ms)
    t0 = time.perf_counter()
    plan = auto_plan(prof, devices, mbs)
    plan_ms = (time.perf_counter() - t0) * 1000
    sim = simulate(plan, fwd, bwd, devices, mbs, re_ms=re)
    # Weight-binding baseline: best balanced contiguous cut into `devices` stages.
    per_layer = [f + r + b for f, r, b in zip(fwd, re, bwd)]
    bound_stages = balanced_stages(per_layer, devices)
    bound = simulate_bound_stages(bound_stages, fwd, bwd, devices, mbs, re_ms=re)
    # A bound stage keeps its weights and gradients on its device.
    _, with_grads = prof.stage_mem()
    bound_gb = max(sum(with_grads[i] for i in r) for r in bound_stages) / GB
    bound_fits = bound_gb <= DEVICE_MEMORY_GB
    same_sched = "1f1b" if len(plan.bwd_plan) <= devices else "gpipe"
    same = simulate(
        plan, fwd, bwd, devices, mbs, re_ms=re, policy="bound", bound_schedule=same_sched
    )
    # Critical path: microbatches pass the slowest stage one after another.
    times = stage_times(plan, prof)
    work = sum(times) * mbs
    slow = times.index(max(times))
    critical = sum(times[:slow]) + mbs * times[slow] + sum(times[slow + 1 :])
    ceiling = work / (devices * max(critical, work / devices))
    cap = 0.6 * DEVICE_MEMORY_GB * GB / 2
    greedy = search_plans("fused", [prof], devices, cap, method="greedy")
    exact_cost = search_plans("fused", [prof], devices, cap)
    gsim = simulate(greedy.plans[0], fwd, bwd, devices, mbs, re_ms=re)
    over = simulate(plan, fwd, bwd, devices, mbs, re_ms=re, iterations=8, overlap_iterations=True)
    return {
        "model": SHAPES[key].name,
        "N": devices,
        "M": mbs,
        "stages": len(plan.fwd_plan) + len(plan.bwd_plan),
        "layout": plan.to_layout_string(),
        "eff": sim.efficiency,
        "vs_bound": bound.makespan_ms / sim.makespan_ms,
        "vs_same": same.makespan_ms / sim.makespan_ms,
        "ceiling": ceiling,
        "greedy_eff": gsim.efficiency,
        "vs_greedy": sim.makespan_ms / gsim.makespan_ms,
        "cost_ratio": exact_cost.cost / greedy.cost,
        "overlap_eff": over.efficiency,
        "overlap_vs_bound": bound.makespan_ms / over.iteration_ms,
        "bound_eff": bound.efficiency,
        "bound_fits": bound_fits,
        "bound_gb": bound_gb,
        "plan_ms": plan_ms,
        "floor_vs_bound": bound.makespan_ms / single_iteration_floor(prof, devices, mbs),
    }


def single_iteration_floor(prof: LayerProfile, devices: int, mbs: int) -> float:
    """No "fused" plan finishes one iteration faster than this, whatever its stages.

    With the fused stage on layers f.. (it must hold the last layer), microbatch 0
    first runs the forward of layers 0..f-1, the fused stage then serves all
    microbatches one after another on one device, and the last microbatch still
    runs the backward of layers f-1..0; the work is also spread over the devices.
    """
    f_ms, b_ms = list(prof.fwd_ms), list(prof.bwd_ms)
    r_ms = list(prof.re_ms or prof.fwd_ms)
    n = len(f_ms)
    best = float("inf")
    for f in range(n):
        before = sum(f_ms[:f]) + sum(r_ms[i] + b_ms[i] for i in range(f))
        fused = sum(f_ms[i] + b_ms[i] for i in range(f, n))
        chain = before + mbs * fused
        spread = mbs * (before + fused) / devices
        best = min(best, max(chain, spread))
    return best


def table() -> list[dict]:
    rows = []
    for key in SHAPES:
        for devices in (1, 2, 4, 8):
            for mbs in sorted({devices + 1, 2 * devices}):
                rows.append(row(key, devices, mbs))
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':<13}{'N':>3}{'M':>4}{'stages':>7}{'eff':>7}{'vs bound':>9}{'vs same':>8}"
        f"{'ceiling':>8}{'greedy':>8}{'/greedy':>8}{'cost':>6}{'overlap':>8}{'vs bound':>9}"
        f"{'plan ms':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        fits = r["bound_fits"]
        vs_bound = f"{r['vs_bound']:>8.2f}x" if fits else f"{'OOM':>9}"
        ov_bound = f"{r['overlap_vs_bound']:>8.2f}x" if fits else f"{'OOM':>9}"
        print(
            f"{r['model']:<13}{r['N']:>3}{r['M']:>4}{r['stages']:>7}{r['eff']:>7.3f}"
            f"{vs_bound}{r['vs_same']:>7.2f}x{r['ceiling']:>8.3f}{r['greedy_eff']:>8.3f}"
            f"{r['vs_greedy']:>8.3f}{r['cost_ratio']:>6.3f}{r['overlap_eff']:>8.3f}"
            f"{ov_bound}{r['plan_ms']:>8.1f}"
        )
    print(
        f"OOM: the bound baseline's stage needs more than {DEVICE_MEMORY_GB:.0f} GB "
        "(bf16 weights + gradients) on one device"
    )
    print()
    for r in rows:
        if r["N"] == 8:
            print(f"{r['model']:<13} N=8 M={r['M']:<3} {r['layout']}")
    print()
    print("What limits one iteration: the critical path through the slowest stage.")
    for r in rows:
        if r["N"] == 8 and r["bound_fits"]:
            print(
                f"  {r['model']:<13} N=8 M={r['M']:<3} any plan is at most "
                f"{r['floor_vs_bound']:.2f}x the bound baseline within one iteration "
                f"(auto: {r['vs_bound']:.2f}x); overlapping iterations: {r['overlap_vs_bound']:.2f}x"
            )


def overlap_report(key: str = "qwen3-1.7b", devices: int = 8, mbs: int = 9) -> list[str]:
    """Overlapped iterations of one case: steady state and optimizer-step sensitivity."""
    prof = SHAPES[key].profile()
    fwd, bwd, re = list(prof.fwd_ms), list(prof.bwd_ms), list(prof.re_ms or prof.fwd_ms)
    plan = auto_plan(prof, devices, mbs)
    per_layer = [f + r + b for f, r, b in zip(fwd, re, bwd)]
    bound = simulate_bound_stages(
        balanced_stages(per_layer, devices), fwd, bwd, devices, mbs, re_ms=re
    )
    one = simulate(plan, fwd, bwd, devices, mbs, re_ms=re)

    def per_iteration(iterations: int, step_ms: float = 0.0) -> float:
        return simulate(
            plan,
            fwd,
            bwd,
            devices,
            mbs,
            re_ms=re,
            iterations=iterations,
            overlap_iterations=True,
            step_ms=step_ms,
        ).iteration_ms

    name = SHAPES[key].name
    lines = [
        f"{name} N={devices} M={mbs}, forward_backward(blocking=False) as simulated "
        f"(one iteration alone: {one.makespan_ms:.1f}, bound baseline: {bound.makespan_ms:.1f} per iteration):",
        f"  8 iterations: {per_iteration(8):.1f} per iteration, "
        f"{bound.makespan_ms / per_iteration(8):.2f}x the bound baseline",
        f"  32 iterations: {per_iteration(32):.1f} per iteration, "
        f"{bound.makespan_ms / per_iteration(32):.2f}x",
    ]
    steps = []
    for step_ms in (0.5 * one.makespan_ms, one.makespan_ms, 1.5 * one.makespan_ms):
        steps.append(f"step {step_ms:.0f}: {bound.makespan_ms / per_iteration(32, step_ms):.2f}x")
    lines.append("  with a host optimizer step (32 iterations): " + ", ".join(steps))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--timeline",
        nargs=3,
        metavar=("MODEL", "DEVICES", "MICROBATCHES"),
        help=f"print the timelines of one case; MODEL in {sorted(SHAPES)}",
    )
    args = parser.parse_args(argv)
    if args.timeline:
        key, n, m = args.timeline[0], int(args.timeline[1]), int(args.timeline[2])
        if key not in SHAPES:
            parser.error(f"unknown model {key!r}; choose from {sorted(SHAPES)}")
        prof = SHAPES[key].profile()
        fwd, bwd = list(prof.fwd_ms), list(prof.bwd_ms)
        plan = auto_plan(prof, n, m)
        print(plan.to_layout_string())
        print("round-robin (F forward, X fused, B backward):")
        print(simulate(plan, fwd, bwd, n, m).timeline(100))
        per_layer = [f + f + b for f, b in zip(fwd, bwd)]
        print("weight-bound 1F1B:")
        print(simulate_bound_stages(balanced_stages(per_layer, n), fwd, bwd, n, m).timeline(100))
        print("3 overlapped iterations (forward_backward(blocking=False)):")
        print(simulate(plan, fwd, bwd, n, m, iterations=3, overlap_iterations=True).timeline(100))
        return 0
    print_table(table())
    print()
    print("\n".join(overlap_report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
