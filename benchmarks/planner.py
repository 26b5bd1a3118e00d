"""Planner table: auto() plans of transformer-shaped profiles, simulated side by side.

Run::

    python benchmarks/planner.py            # the tables (about 20 s on 2 cores)
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
* ``greedy``: the published greedy planner's plan (:func:`published_greedy`,
  rewritten from the published ``ModelExecutePlan.auto`` rules), its simulated
  efficiency, and our makespan relative to it (< 1 is faster); ``cost``: the
  published cost ``max(S, min_stages) x slowest stage`` of our exact search
  relative to that of the published planner's plan
  (``OOM`` where a bound stage's bf16 weights and gradients exceed a 24 GB device);
* below the table, for every row: the fastest plan a broad search finds
  (:func:`broad_search`: every fused split x every pair of forward / backward stage
  counts up to 3N+2, each side balanced, simulated), as a speedup over the bound
  baseline — "any plan is at most Xx ... (auto: Yx = Y/X of the best)" — beside
  the critical-path floor no plan can beat (``single_iteration_floor``); then
  auto against the published planner: time per iteration and peak memory per
  device (weights + gradients, ``simulate(...).peak_bytes``);
* at the end: auto's planning time (process CPU time) for 128 and 512 layers;
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
  thread and iteration k needs step k-2 -- per layer: its weights are published
  layer by layer and a job waits only for its own layers -- so a step longer
  than an iteration becomes the pace. Two step models: one call after the whole
  iteration (today's ``step_fn``), and a step taken layer by layer as soon as a
  layer's last gradient is in (``simulate(step_per_layer=True)``, shares in
  proportion to parameter bytes; what ``RoundPipe.step_layerwise`` runs); the
  "Lightning path" line is the strategy's ``async_step=True`` with a host step of
  half an iteration.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from bound_baseline import balanced_stages, simulate_bound, simulate_bound_stages

from roundpipe_core.planning.plan import ModelExecutePlan
from roundpipe_core.planning.profile import LayerProfile
from roundpipe_core.planning.search import plan_cost, search_plans
from roundpipe_core.planning.simulate import simulate, simulated_iteration_ms

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


def published_greedy(
    prof: LayerProfile, min_stages: int, mem_limit_bytes: float, upper_threshold: float = 1.1
) -> ModelExecutePlan:
    """The published RoundPipe planner for one model and ``forward_backward`` (its
    ``ModelExecutePlan.auto("fused", model)``), rewritten from its documented rules.

    Its times per layer are the recompute estimate as the forward time and
    recompute + backward as the backward time (the fused stage is costed like a
    backward stage). Candidate stage caps are the sums of contiguous layers of
    either list between the slowest single layer and ``upper_threshold`` times
    that. For each cap: the fused stage takes the deepest layers whose backward
    times fit the cap (and half the memory limit); the forward stages are packed
    greedily from the deepest remaining layer down, the backward stages from
    layer 0 up. The cost ``max(stages, min_stages) x cap`` is minimised, the
    smallest cap winning ties.
    """
    re = list(prof.re_ms or prof.fwd_ms)
    fwd_t = re
    bwd_t = [r + b for r, b in zip(re, prof.bwd_ms)]
    fmem, bmem = prof.stage_mem()
    half = mem_limit_bytes / 2
    n = len(fwd_t)
    top = max(fwd_t + bwd_t)
    caps = []
    for times in (fwd_t, bwd_t):
        for i in range(n):
            total = 0.0
            for j in range(i, n):
                total += times[j]
                if total > top * upper_threshold:
                    break
                if total >= top:
                    caps.append(total)
    best, best_cost = None, float("inf")
    for cap in sorted(caps):
        fused_start, t, m = n, 0.0, 0.0
        for i in range(n - 1, -1, -1):
            if t + bwd_t[i] > cap or m + bmem[i] > half:
                break
            t, m, fused_start = t + bwd_t[i], m + bmem[i], i
        fwd: list[range] = []  # deepest first
        stop, t, m = fused_start, 0.0, 0.0
        for i in range(fused_start - 1, -1, -1):
            if i + 1 < stop and (t + fwd_t[i] > cap or m + fmem[i] > half):
                fwd.append(range(i + 1, stop))
                stop, t, m = i + 1, 0.0, 0.0
            t, m = t + fwd_t[i], m + fmem[i]
        if stop > 0:
            fwd.append(range(0, stop))
        bwd: list[range] = []
        start, t, m = 0, 0.0, 0.0
        for i in range(fused_start):  # shallowest first
            if i > start and (t + bwd_t[i] > cap or m + bmem[i] > half):
                bwd.append(range(start, i))
                start, t, m = i, 0.0, 0.0
            t, m = t + bwd_t[i], m + bmem[i]
        if fused_start > 0:
            bwd.append(range(start, fused_start))
        plan = ModelExecutePlan(fwd[::-1], [range(fused_start, n)] + bwd[::-1])
        cost = max(len(plan.fwd_plan) + len(plan.bwd_plan), min_stages) * cap
        if cost < best_cost:
            best, best_cost = plan, cost
    assert best is not None
    return best


def broad_search(
    prof: LayerProfile, devices: int, mbs: int, mem_cap: float
) -> tuple[float, ModelExecutePlan, int]:
    """The fastest simulated "fused" plan among every fused split and every pair of
    forward / backward stage counts (up to 3 x devices + 2 each), each side
    partitioned as evenly as possible, within the per-stage memory cap."""
    f_ms, b_ms = list(prof.fwd_ms), list(prof.bwd_ms)
    r_ms = list(prof.re_ms or prof.fwd_ms)
    back = [r + b for r, b in zip(r_ms, b_ms)]
    fmem, bmem = prof.stage_mem()
    n, most = len(f_ms), 3 * devices + 2
    best, best_plan, tried = float("inf"), None, 0

    def fits(stages: list[range], mem: list[float]) -> bool:
        return all(sum(mem[i] for i in r) <= mem_cap for r in stages)

    for f in range(n):
        if sum(bmem[f:]) > mem_cap:
            continue
        if f == 0:
            sides = [([], [])]
        else:
            ks = range(1, min(f, most) + 1)
            fws = [p for p in (balanced_stages(f_ms[:f], k) for k in ks) if fits(p, fmem)]
            bws = [p for p in (balanced_stages(back[:f], k) for k in ks) if fits(p, bmem)]
            sides = [(a, b[::-1]) for a in fws for b in bws]
        for fw, bw in sides:
            plan = ModelExecutePlan(fw, [range(f, n)] + bw)
            ms = simulated_iteration_ms(plan, prof, "fused", devices, mbs)
            tried += 1
            if ms < best:
                best, best_plan = ms, plan
    assert best_plan is not None
    return best, best_plan, tried


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
    same = simulate_bound(plan, fwd, bwd, devices, mbs, re_ms=re, schedule=same_sched)
    # Critical path: microbatches pass the slowest stage one after another.
    times = stage_times(plan, prof)
    work = sum(times) * mbs
    slow = times.index(max(times))
    critical = sum(times[:slow]) + mbs * times[slow] + sum(times[slow + 1 :])
    ceiling = work / (devices * max(critical, work / devices))
    cap = 0.6 * DEVICE_MEMORY_GB * GB / 2
    gplan = published_greedy(prof, devices, 2 * cap)
    exact_cost = search_plans("fused", [prof], devices, cap)
    sizes = {"param_bytes": prof.param_bytes, "grad_bytes": prof.param_bytes}
    gsim = simulate(gplan, fwd, bwd, devices, mbs, re_ms=re, **sizes)
    sim = simulate(plan, fwd, bwd, devices, mbs, re_ms=re, **sizes)
    best_ms, best_plan, tried = broad_search(prof, devices, mbs, cap)
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
        "cost_ratio": exact_cost.cost / plan_cost(gplan, prof, "fused", devices)[0],
        "iter": sim.makespan_ms,
        "greedy_iter": gsim.makespan_ms,
        "peak_gb": max(sim.peak_bytes) / GB,
        "greedy_peak_gb": max(gsim.peak_bytes) / GB,
        "greedy_layout": gplan.to_layout_string(),
        "best_vs_bound": bound.makespan_ms / best_ms,
        "auto_of_best": best_ms / sim.makespan_ms,
        "best_layout": best_plan.to_layout_string(),
        "searched": tried,
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
    print(
        "Auto against a broad search (every fused split x forward/backward stage counts up "
        "to 3N+2, each side balanced; simulated), one iteration:"
    )
    for r in rows:
        print(
            f"  {r['model']:<13} N={r['N']} M={r['M']:<3} any plan is at most "
            f"{r['best_vs_bound']:.2f}x the bound baseline ({r['searched']} searched; "
            f"critical-path floor {r['floor_vs_bound']:.2f}x) "
            f"(auto: {r['vs_bound']:.2f}x = {r['auto_of_best']:.3f} of the best)"
        )
    worst = min(rows, key=lambda r: r["auto_of_best"])
    print(
        f"  worst row: auto reaches {worst['auto_of_best']:.3f} of the best plan searched "
        f"({worst['model']} N={worst['N']} M={worst['M']})"
    )
    print()
    print(
        "Auto against the published greedy planner (rewritten from its rules): time per "
        "iteration (profile units) and peak memory per device (GB, weights + gradients):"
    )
    print(f"  {'model':<13}{'N':>3}{'M':>4}{'auto':>9}{'GB':>7}{'greedy':>9}{'GB':>7}{'ratio':>7}")
    for r in rows:
        print(
            f"  {r['model']:<13}{r['N']:>3}{r['M']:>4}{r['iter']:>9.1f}{r['peak_gb']:>7.2f}"
            f"{r['greedy_iter']:>9.1f}{r['greedy_peak_gb']:>7.2f}{r['vs_greedy']:>7.3f}"
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

    def per_iteration(iterations: int, step_ms: float = 0.0, per_layer: bool = False) -> float:
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
            step_per_layer=per_layer,
            step_share=prof.param_bytes,
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
    for per_layer, what in (
        (False, "one step call after the iteration"),
        (True, "stepped layer by layer as gradients complete"),
    ):
        steps = []
        for frac in (0.5, 1.0, 1.5):
            ms = frac * one.makespan_ms
            steps.append(
                f"step {ms:.0f} ({frac:g} it.): "
                f"{bound.makespan_ms / per_iteration(32, ms, per_layer):.2f}x"
            )
        lines.append(f"  with a host optimizer step, {what} (32 iterations): " + ", ".join(steps))
    lines.append(
        "  Lightning path (async_step=True runs forward_backward(blocking=False) and, for an "
        "elementwise optimizer without clipping, step_layerwise; weights are published per "
        "layer, a job waits only for its own layers): step of half an iteration "
        f"{bound.makespan_ms / per_iteration(32, 0.5 * one.makespan_ms, True):.2f}x "
        f"({bound.makespan_ms / per_iteration(32, 0.5 * one.makespan_ms):.2f}x with clipping "
        "or another optimizer: one step call)"
    )
    steady = ModelExecutePlan.auto(
        "fused",
        prof,
        min_stages=devices,
        model_memory_limit=0.6 * DEVICE_MEMORY_GB,
        num_microbatch=mbs,
        overlap_iterations=True,
    )
    ov = simulate(
        steady, fwd, bwd, devices, mbs, re_ms=re, iterations=32, overlap_iterations=True
    ).iteration_ms
    lines.append(
        f"  planned for overlap (auto(..., overlap_iterations=True): {steady.to_layout_string()}): "
        f"32 iterations: {ov:.1f} per iteration, {bound.makespan_ms / ov:.2f}x"
    )
    return lines


def planning_times(repeats: int = 5) -> list[str]:
    """CPU time of ``auto("fused")`` for deep Llama-shaped profiles (median and spread)."""
    lines = ["Planning time (auto, fused, process CPU time, median [min..max] of 5):"]
    shape = SHAPES["llama-8b"]
    for layers in (128, 512):
        prof = Shape(
            shape.name,
            layers - 2,
            shape.hidden,
            shape.intermediate,
            shape.kv_dim,
            shape.vocab,
            shape.head_ratio,
        ).profile()
        for devices in (2, 8):
            runs = []
            for _ in range(repeats):
                t0 = time.process_time()
                auto_plan(prof, devices, devices + 1)
                runs.append((time.process_time() - t0) * 1000)
            runs.sort()
            lines.append(
                f"  {layers} layers, N={devices} M={devices + 1}: {runs[len(runs) // 2]:.0f} ms "
                f"[{runs[0]:.0f}..{runs[-1]:.0f}]"
            )
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
    print()
    print("\n".join(planning_times()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
