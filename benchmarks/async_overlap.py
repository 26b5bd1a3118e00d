"""How much of an optimizer step the engine hides behind the next iteration.

    python benchmarks/async_overlap.py [--rounds 8] [--iters 4] [--step-ms auto]
                                       [--grad-hook] [--lightning-rounds 4] [--no-lightning]
                                       [--no-core]

With ``--iters`` steps per variant, the last step of the asynchronous variants cannot
overlap anything (the variant ends with ``synchronize()``): the best sync / async ratio
is then 2 / (1 + 1 / iters) -- 1.6 at 4 iterations, 1.88 at 16. ``--grad-hook``
registers a grad hook (as the data-parallel reducer does), the path where gradients
enter ``.grad`` while the call still runs.

The step is made as long as one iteration (a sleep plus a tiny SGD step, sized to
the measured iteration unless ``--step-ms`` is given), the case where overlap
matters most: a loop that waits for every step takes iteration + step per step,
one that hides the step fully takes max(iteration, step), the ideal.

Core variants, each ``--iters`` steps of one MLP on ``--devices`` CPU workers, run
round by round, interleaved:

- ``sync``: ``forward_backward()`` then ``step(is_async=False)``;
- ``async``: ``forward_backward()`` then ``step(is_async=True)``;
- ``blocking=False``: ``forward_backward(blocking=False)`` then ``step(is_async=True)``
  (overlapped iterations), results collected at the end (not with ``--grad-hook``:
  non-blocking calls do not support grad hooks);
- ``blocking=False, layer-wise``: the same with ``step_layerwise`` (each layer's share
  of the step, in proportion to its parameters, runs as soon as its gradients are
  complete);
- ``iteration only`` / ``step only``: the two halves alone, for the ideal.

Printed: ms per step (median and interquartile spread), the per-round ratios
sync / variant (median and spread; the ideal ratio is sync / ideal), and the share
of the possible overlap each variant recovers, (sync - variant) / (sync - ideal).

Lightning (unless ``--no-lightning``): the same network trained by
``Trainer(strategy=RoundPipeStrategy(async_step=...))`` with an SGD whose step
sleeps as long as a measured Lightning iteration (in proportion to the parameters
it steps); ms per step after the first, and ``async_step=False`` / variant per
round, for ``async_step=True`` with the step in one call and with the same
optimizer declared elementwise, which the strategy steps layer by layer.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _interleave import Timing, format_table, interleave
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.stepping.layerwise import step_subset


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 4:  # too few for quartiles: the full range instead
        return statistics.median(values), min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), q[0], q[2]


class Core:
    """One RoundPipe per variant (the same network and data), so no variant inherits
    another's pending work."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.x = torch.randn(args.batch, args.width)
        self.y = torch.randn(args.batch, args.width)
        self.step_s = 0.0
        self._rps: list[RoundPipe] = []
        # per RoundPipe: its step in parts (step_layerwise) and the zero_grad after it
        self.parts: dict[int, tuple[Callable[[list[torch.Tensor]], None], Callable[[], None]]] = {}

    def new(self) -> tuple[RoundPipe, Callable[[], None]]:
        a = self.args
        plan = ModelExecutePlan.uniform(a.layers, a.stages, "fused") if a.stages else None
        rp = RoundPipe(
            build(a.width, a.layers),
            devices=f"cpu:{a.devices}",
            optim_dtype=torch.float32,
            model_run_config=RoundPipeRunConfig(num_microbatch=a.microbatches, execute_plan=plan),
        )
        self._rps.append(rp)
        if a.grad_hook:
            # what a data-parallel reducer registers: gradients are merged into .grad and
            # reported per master while the call runs, not at its end
            rp.register_grad_hook(lambda masters: None)
        opt = torch.optim.SGD(rp.optim_parameters(), lr=1e-4)

        total = sum(p.numel() for p in rp.optim_parameters())

        def step_fn() -> None:
            time.sleep(self.step_s)
            opt.step()
            opt.zero_grad()

        def step_part(params: list[torch.Tensor]) -> None:
            # a part's share of the step, in proportion to its parameters
            time.sleep(self.step_s * sum(p.numel() for p in params) / total)
            step_subset(opt, params)

        self.parts[id(rp)] = (step_part, opt.zero_grad)
        return rp, step_fn

    def fb(self, rp: RoundPipe, blocking: bool = True) -> Any:
        return rp.forward_backward((self.x,), label=self.y, loss_fn=loss_fn, blocking=blocking)

    def variants(self) -> dict[str, Callable[[], None]]:
        n = self.args.iters
        rp_sync, step_sync = self.new()
        rp_async, step_async = self.new()
        rp_pipe, step_pipe = self.new()
        rp_layer, _ = self.new()
        rp_iter, _ = self.new()
        _, step_only = self.new()

        def sync() -> None:
            for _ in range(n):
                self.fb(rp_sync)
                rp_sync.step(step_sync, is_async=False)

        def asynchronous() -> None:
            for _ in range(n):
                self.fb(rp_async)
                rp_async.step(step_async, is_async=True)
            rp_async.synchronize()

        def pipelined() -> None:
            pending = []
            for _ in range(n):
                pending.append(self.fb(rp_pipe, blocking=False))
                rp_pipe.step(step_pipe, is_async=True)
            for p in pending:
                p.result(timeout=600)
            rp_pipe.synchronize()

        def layerwise() -> None:
            step_part, finish = self.parts[id(rp_layer)]
            pending = []
            for _ in range(n):
                pending.append(self.fb(rp_layer, blocking=False))
                rp_layer.step_layerwise(step_part, finish)
            for p in pending:
                p.result(timeout=600)
            rp_layer.synchronize()

        def iteration() -> None:
            for _ in range(n):
                self.fb(rp_iter)
                for p in rp_iter.optim_parameters():  # no step: drop the gradients instead
                    p.grad = None

        def step() -> None:
            for _ in range(n):
                step_only()

        out = {
            "sync": sync,
            "async": asynchronous,
            "blocking=False": pipelined,
            "blocking=False, layer-wise": layerwise,
        }
        if self.args.grad_hook:
            del out["blocking=False"], out["blocking=False, layer-wise"]
        return {**out, "iteration only": iteration, "step only": step}

    def calibrate(self) -> float:
        """Median seconds of one blocking iteration (no step)."""
        rp, _ = self.new()
        times = []
        for _ in range(8):  # the first calls pay for allocation and thread start-up
            t0 = time.perf_counter()
            self.fb(rp)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[3:])

    def close(self) -> None:
        for rp in self._rps:
            rp.close()


def report(timings: dict[str, Timing], iters: int, baseline: str, ideal: list[str]) -> None:
    """Per-step table, per-round ratios to ``baseline`` and the overlap recovered, where
    the ideal per round is the larger of the two ``ideal`` variants."""
    per_step = {k: Timing(k, [s / iters for s in t.seconds]) for k, t in timings.items()}
    print(format_table(per_step, [baseline]))
    base = per_step[baseline].seconds
    ideal_s = [max(a, b) for a, b in zip(*(per_step[k].seconds for k in ideal))]
    print(
        f"ideal max({', '.join(ideal)}): {statistics.median(ideal_s) * 1e3:.1f} ms/step "
        f"(per-round {baseline} / ideal: "
        + "{:.2f} [{:.2f}..{:.2f}])".format(*_quartiles([b / i for b, i in zip(base, ideal_s)]))
    )
    for k, t in per_step.items():
        if k == baseline or k in ideal:
            continue
        ratio = _quartiles([b / s for b, s in zip(base, t.seconds)])
        recovered = _quartiles(
            [(b - s) / (b - i) for b, s, i in zip(base, t.seconds, ideal_s) if b > i]
        )
        print(
            f"  {baseline} / {k}: {ratio[0]:.2f} [{ratio[1]:.2f}..{ratio[2]:.2f}]   "
            f"overlap recovered: {recovered[0]:.0%} [{recovered[1]:.0%}..{recovered[2]:.0%}]"
        )


# -- Lightning ----------------------------------------------------------------------------


def lightning_bench(args: argparse.Namespace) -> None:
    import lightning as L

    # Trainer start-up chatter would bury the numbers
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from torch.utils.data import DataLoader, TensorDataset

    from roundpipe_lightning import RoundPipeStrategy

    steps = args.iters + 1  # the first step (setup, first upload) is not timed
    data = TensorDataset(
        torch.randn(steps * args.batch, args.width), torch.randn(steps * args.batch, args.width)
    )
    sleep_s = [0.0]

    class SleepySGD(torch.optim.SGD):
        """SGD whose step also sleeps: a host step as long as an iteration, in proportion
        to the parameters it steps (all of them, or a layer-wise step's part)."""

        total = 0

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            n = sum(p.numel() for g in self.param_groups for p in g["params"])
            time.sleep(sleep_s[0] * n / (self.total or n))
            return super().step(closure)

    class SleepyPartsSGD(SleepySGD):
        """The same, declared elementwise: the strategy steps it layer by layer."""

        roundpipe_elementwise = True

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if idx == 1:
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            pl_module.roundpipe.synchronize()  # the last step is part of the time
            self.t1 = time.perf_counter()

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build(args.width, args.layers)

        def configure_sequential(self) -> nn.Module:
            return self.net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)

        def configure_optimizers(self) -> Any:
            cls = SleepyPartsSGD if self.layerwise else SleepySGD
            opt = cls(self.parameters(), lr=1e-4)
            opt.total = sum(p.numel() for p in self.parameters())
            return opt

    def fit(async_step: bool, layerwise: bool = False) -> float:
        clock = Clock()
        trainer = L.Trainer(
            strategy=RoundPipeStrategy(async_step=async_step),
            accelerator="cpu",
            devices=args.devices,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[clock],
        )
        loader = DataLoader(data, batch_size=args.batch)
        lit = Lit()
        lit.layerwise = layerwise
        trainer.fit(lit, loader)
        return (clock.t1 - clock.t0) / (steps - 1)

    iteration_s = statistics.median(fit(False) for _ in range(2))
    sleep_s[0] = iteration_s if args.step_ms is None else args.step_ms / 1e3
    variants = {
        "async_step=False": lambda: fit(False),
        "async_step=True, one step call": lambda: fit(True),
        "async_step=True, layer-wise": lambda: fit(True, layerwise=True),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.lightning_rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for k in order:
            times[k].append(variants[k]())
    ideal = max(iteration_s, sleep_s[0])
    print(
        f"\nLightning, {steps - 1} timed steps per fit, {args.lightning_rounds} interleaved "
        f"rounds; iteration without step {iteration_s * 1e3:.1f} ms, step sleeps "
        f"{sleep_s[0] * 1e3:.1f} ms (in proportion to the parameters stepped); ideal "
        f"max(iteration, step) {ideal * 1e3:.1f} ms/step"
    )
    base = times["async_step=False"]
    s = statistics.median(base)
    print(f"  async_step=False: {s * 1e3:.1f} ms/step (False / ideal {s / ideal:.2f})")
    for k in list(variants)[1:]:
        a = statistics.median(times[k])
        ratio = _quartiles([x / y for x, y in zip(base, times[k])])
        line = f"  {k}: {a * 1e3:.1f} ms/step, False / it: {ratio[0]:.2f} [{ratio[1]:.2f}..{ratio[2]:.2f}]"
        if s > ideal:
            line += f"; overlap recovered {(s - a) / (s - ideal):.0%}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4, help="uniform plan stages (0: auto)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--iters", type=int, default=4, help="steps per variant and round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--step-ms", type=float, default=None, help="step length (default: one iteration)"
    )
    ap.add_argument(
        "--grad-hook",
        action="store_true",
        help="register a (no-op) grad hook on the core RoundPipes, as data-parallel does",
    )
    ap.add_argument("--lightning-rounds", type=int, default=4)
    ap.add_argument("--no-lightning", action="store_true")
    ap.add_argument("--no-core", action="store_true", help="the Lightning part only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.no_core:
        core_bench(args)
    if not args.no_lightning:
        lightning_bench(args)


def core_bench(args: argparse.Namespace) -> None:

    core = Core(args)
    try:
        iteration_s = core.calibrate()
        core.step_s = iteration_s if args.step_ms is None else args.step_ms / 1e3
        print(
            f"{args.layers} x (Linear({args.width}) + GELU), batch {args.batch}, "
            f"{args.microbatches} microbatches, {args.devices} CPU workers, torch threads "
            f"{torch.get_num_threads()}; iteration {iteration_s * 1e3:.1f} ms, step sleeps "
            f"{core.step_s * 1e3:.1f} ms; {args.iters} steps per variant, {args.rounds} "
            "interleaved rounds (ms per step)"
        )
        timings = interleave(core.variants(), rounds=args.rounds, warmup=1)
    finally:
        core.close()
    report(timings, args.iters, "sync", ["iteration only", "step only"])


if __name__ == "__main__":
    main()
