"""What RoundPipe's optimizer step costs next to torch's fused AdamW alone.

    python benchmarks/step_cost.py [--params 20e6,100e6] [--width 1024] [--rounds 7]
                                   [--dtypes fp32,bf16] [--threads N]

For each size (an ``nn.Sequential`` of ``Linear(width, width)`` layers holding about
that many parameters) and each weight dtype (``fp32``: fp32 weights and masters;
``bf16``: bf16 weights, fp32 masters, so the copy back to the model is a cast), one
process times, interleaved round by round (the order rotates each round, as in
``benchmarks/_interleave.py``), with gradients present before every timed call:

- ``torch fused AdamW``: ``torch.optim.AdamW(params, fused=True).step()`` alone on plain
  fp32 tensors of the same shapes -- the baseline;
- ``torch fused AdamW, in a loop``: the same step in a plain PyTorch training loop (a
  forward and backward of an identical fp32 model, untimed, before each timed step):
  the step as a training loop sees it, with fresh gradients;
- ``torch fused AdamW + cast copy`` (bf16 weights only): that step followed by one
  ``torch._foreach_copy_`` of the fp32 results into bf16 weights, what plain PyTorch
  with fp32 master weights and bf16 model weights does after each step: the
  like-for-like baseline of a synchronous step on bf16 weights;
- ``rp step(sync)``: after a ``forward_backward`` (one CPU worker, untimed),
  ``rp.step(step_fn, is_async=False)`` with the same fused AdamW over
  ``rp.optim_parameters()`` and ``step_fn = opt.step(); opt.zero_grad()``: the step,
  ``zero_grad``, the hand-off to the optimizer thread and the copy into the model;
  for fp32 weights also ``rp step(sync), shared masters``: the same with
  ``RoundPipe(shared_masters=True)`` (``RoundPipeStrategy(async_step=False)``'s
  choice), where the weights are the masters and nothing is copied;
- its pieces, each on its own: ``merge`` (a call's downloaded gradients -- in the
  weight dtype -- into the masters' ``.grad``: what ``forward_backward`` does after its
  backward; ``merge, accumulating`` when ``.grad`` already holds a window's earlier
  gradients), ``step + zero_grad`` on the masters, ``copy to model``
  (``MasterWeights.copy_to_model``), and that copy again while another thread runs
  Python (``copy, Python thread busy``), next to the same copy as a per-tensor loop
  (``same as a loop, busy``): a loop re-takes the GIL for every tensor and may wait a
  switch interval each time (the CPU column of these two counts the busy thread);
- the asynchronous path: ``rp step(async): caller`` is ``rp.step(step_fn)`` right after
  a ``forward_backward`` whose previous step has finished (it overlapped the call):
  what stays on the caller's critical path (queueing: the copy of the previous step's
  weights into the model runs on the optimizer thread, ahead of the step, overlapped
  with the next call, which waits for each layer's copy only); ``async: optimizer
  thread`` is that step as the optimizer thread runs it; ``publish (pipelined)`` is the
  per-layer copy the optimizer thread does before it (the same code after blocking and
  after non-blocking calls), each layer released as soon as it is copied;
- ``prototype: layered step+copy``: not RoundPipe's code -- the same AdamW update
  stepped one layer at a time (a fused AdamW per layer) with each layer's copy to the
  model handed to a second thread as soon as that layer is stepped: what overlapping
  the copy with the step of the next layer would cost on this machine.

Each call is timed on the wall clock and on this process's CPU time (all threads),
which the load of other processes on a shared machine disturbs far less; the table
gives the median, the interquartile spread and the ratio of medians to the baseline,
and the median count of minor page faults per call (fresh memory the kernel maps in:
on a virtual machine each costs microseconds, so an allocation pattern that keeps
returning memory to the system shows up here).
The ``async: optimizer thread`` row is measured inside the step on that thread (its
CPU column is that thread's CPU time). The ``async: caller`` CPU column also counts
the optimizer thread's first moments of the step it has just queued.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from _interleave import Timing
from torch import nn

from roundpipe_core import RoundPipe, RoundPipeRunConfig
from roundpipe_core.stepping.pipelined import GradBuffer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BASE = "torch fused AdamW"

Prepared = tuple[Callable[[], object], Callable[[], object]]  # (prepare, timed call)


def build(params: float, width: int, dtype: torch.dtype) -> nn.Sequential:
    """Linear layers holding about ``params`` parameters."""
    torch.manual_seed(0)
    layers = max(1, round(params / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(dtype)


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():
        torch._foreach_copy_(dst, src)


class _Spinner:
    """A thread running pure Python while started -- as a worker's bookkeeping or a data
    loader would, at worst -- so work that re-takes the GIL often has to queue for it:
    the spinning thread gives the GIL up only when the interpreter's switch interval
    makes it."""

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._spinning = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="step-cost-spin", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._closed:
            if not self._wake.wait(0.1):
                continue
            while self._spinning:
                n += 1

    def start(self) -> None:
        self._spinning = True
        self._wake.set()
        time.sleep(0.01)  # let it take the GIL

    def stop(self) -> None:
        self._spinning = False
        self._wake.clear()

    def close(self) -> None:
        self._closed = True
        self.stop()
        self._wake.set()
        self._thread.join(5.0)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_rounds(
    variants: dict[str, Prepared], rounds: int, warmup: int = 1
) -> dict[str, tuple[Timing, Timing, list[int]]]:
    """Per variant (wall, process CPU) seconds of its timed call and the page faults it
    took, one per round; the untimed ``prepare`` runs right before each call, the order
    rotates every round."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            prepare, call = variants[name]
            prepare()
            call()
    out: dict[str, tuple[Timing, Timing, list[int]]] = {
        n: (Timing(n, []), Timing(n, []), []) for n in names
    }
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            prepare, call = variants[name]
            prepare()
            f0, c0, t0 = _faults(), time.process_time(), time.perf_counter()
            call()
            out[name][0].seconds.append(time.perf_counter() - t0)
            out[name][1].seconds.append(time.process_time() - c0)
            out[name][2].append(_faults() - f0)
    return out


Row = tuple[str, Timing, Timing, list[int]]  # name, wall, CPU, page faults per call


def bench(params: float, width: int, dtype: torch.dtype, rounds: int) -> list[Row]:
    """The rows of one table, the baseline first."""
    model = build(params, width, dtype)
    gen = torch.Generator().manual_seed(1)
    # the same gradients for every contender, in the weight dtype (what a device downloads)
    grads = [torch.randn(p.shape, generator=gen).mul_(1e-2).to(dtype) for p in model.parameters()]

    # (a) the baseline: plain fp32 tensors, fused AdamW alone
    plain = [p.detach().float().clone() for p in model.parameters()]
    plain_grads = [g.float() for g in grads]
    base_opt = torch.optim.AdamW(plain, fused=True)

    def set_plain_grads() -> None:
        for p, g in zip(plain, plain_grads):
            p.grad = g

    # the same fused AdamW inside a plain PyTorch training loop: a forward and backward
    # of an identical fp32 model before each timed step, so its memory is in the state a
    # training loop leaves it in (fresh gradients, activations come and go)
    loop_model = build(params, width, torch.float32)
    loop_opt = torch.optim.AdamW(loop_model.parameters(), fused=True)
    loop_x = torch.randn(2, width, generator=gen)
    loop_y = torch.zeros(2, width)

    def plain_forward_backward() -> None:
        loop_opt.zero_grad()
        nn.functional.mse_loss(loop_model(loop_x), loop_y).backward()

    # plain PyTorch with low-precision weights and fp32 masters pays the same cast copy
    # after its step: the like-for-like baseline of a synchronous step on bf16 weights
    low_weights = [p.detach().clone() for p in model.parameters()]

    def step_and_cast() -> None:
        base_opt.step()
        _copy(low_weights, plain)

    # a prototype of the copy overlapping the step: the same update stepped one layer at
    # a time (an optimizer per layer), each layer's copy handed to a second thread
    proto = [p.detach().clone() for p in plain]
    proto_model = [p.detach().clone() for p in model.parameters()]
    per_layer = [len(list(layer.parameters())) for layer in model]
    bounds = [sum(per_layer[:i]) for i in range(len(per_layer) + 1)]
    layer_opts = [torch.optim.AdamW(proto[a:b], fused=True) for a, b in zip(bounds, bounds[1:])]
    copier = ThreadPoolExecutor(1, thread_name_prefix="step-cost-copy")

    def set_proto_grads() -> None:
        for p, g in zip(proto, plain_grads):
            p.grad = g

    def layered_step_and_copy() -> None:
        copies = []
        for o, a, b in zip(layer_opts, bounds, bounds[1:]):
            o.step()
            copies.append(copier.submit(_copy, proto_model[a:b], proto[a:b]))
        for c in copies:
            c.result()

    # (b), (c) RoundPipe on one CPU worker
    rp = RoundPipe(model, optim_dtype=torch.float32, devices=1)
    masters = rp.masters
    opt = torch.optim.AdamW(rp.optim_parameters(), fused=True)
    cfg = RoundPipeRunConfig(num_microbatch=1)
    x = torch.randn(2, width, generator=gen).to(dtype)
    y = torch.zeros(2, width, dtype=dtype)
    model_params = [p for _, p, _ in masters.entries]

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    def forward_backward() -> None:
        rp.synchronize()  # nothing in flight from the previous variant
        rp.forward_backward(
            input_args=(x,), label=y, loss_fn=nn.functional.mse_loss, run_config=cfg
        )

    def set_master_grads() -> None:
        rp.synchronize()
        for (_, _, m), g in zip(masters.entries, plain_grads):
            m.grad = g

    # fp32 weights: the same step with shared masters (the weights are the masters,
    # RoundPipeStrategy(async_step=False)'s choice), so there is nothing to copy
    shared = None
    if dtype == torch.float32:
        shared = RoundPipe(
            build(params, width, dtype), optim_dtype=torch.float32, devices=1, shared_masters=True
        )
        shared_opt = torch.optim.AdamW(shared.optim_parameters(), fused=True)

        def shared_step_fn() -> None:
            shared_opt.step()
            shared_opt.zero_grad()

        def shared_forward_backward() -> None:
            assert shared is not None
            shared.synchronize()
            shared.forward_backward(
                input_args=(x,), label=y, loss_fn=nn.functional.mse_loss, run_config=cfg
            )

    merge_buffer = GradBuffer(masters.master_of)
    acc = [torch.zeros_like(m) for m in rp.optim_parameters()]
    downloaded: list[torch.Tensor] = []

    def fresh_grads(accumulating: bool) -> Callable[[], None]:
        def prepare() -> None:
            rp.synchronize()
            for (_, _, m), a in zip(masters.entries, acc):
                m.grad = a if accumulating else None
            # what a device hands over: new tensors, which the merge may keep as .grad
            downloaded[:] = [g.clone() for g in grads]

        return prepare

    def merge() -> None:
        # as forward_backward does: the worker's grad sink, then the fold into .grad
        for p, g in zip(model_params, downloaded):
            merge_buffer.add(p, g)
        masters.add_many(merge_buffer.take())

    # the step of the async variant, timed where it runs (the optimizer thread)
    thread_wall: list[float] = []
    thread_cpu: list[float] = []
    thread_faults: list[int] = []

    def timed_step_fn() -> None:
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        c0, t0 = time.thread_time(), time.perf_counter()
        step_fn()
        thread_wall.append(time.perf_counter() - t0)
        thread_cpu.append(time.thread_time() - c0)
        thread_faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)

    def async_prepare() -> None:
        # the steady state of a blocking loop with asynchronous steps: the previous step
        # ran during this forward_backward and has finished; its weights are not copied yet
        forward_backward()
        rp.step(step_fn)
        rp.forward_backward(
            input_args=(x,), label=y, loss_fn=nn.functional.mse_loss, run_config=cfg
        )
        rp.wait_step()

    versions = rp._steps.versions  # the pipelined path's per-layer publication

    def publish() -> None:
        newer = max(versions.version.values(), default=0) + 1
        versions.publish(newer, lambda: False)

    def loop_copy() -> None:  # copy_to_model as a per-tensor loop, for comparison
        with torch.no_grad():
            for _, p, m in masters.entries:
                p.copy_(m)

    busy = _Spinner()

    def start_spinning() -> None:
        rp.synchronize()
        busy.start()

    def while_busy(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            fn()
            busy.stop()

        return call

    variants: dict[str, Prepared] = {
        BASE: (set_plain_grads, base_opt.step),
        "torch fused AdamW, in a loop": (plain_forward_backward, loop_opt.step),
        **(
            {"torch fused AdamW + cast copy": (set_plain_grads, step_and_cast)}
            if dtype != torch.float32
            else {}
        ),
        "rp step(sync)": (forward_backward, lambda: rp.step(step_fn, is_async=False)),
        **(
            {
                "rp step(sync), shared masters": (
                    shared_forward_backward,
                    lambda: shared.step(shared_step_fn, is_async=False),
                )
            }
            if shared is not None
            else {}
        ),
        "  merge": (fresh_grads(False), merge),
        "  merge, accumulating": (fresh_grads(True), merge),
        "  step + zero_grad": (set_master_grads, step_fn),
        "  copy to model": (rp.synchronize, masters.copy_to_model),
        "  copy, Python thread busy": (start_spinning, while_busy(masters.copy_to_model)),
        "  same as a loop, busy": (start_spinning, while_busy(loop_copy)),
        "rp step(async): caller": (async_prepare, lambda: rp.step(timed_step_fn)),
        "publish (pipelined)": (rp.synchronize, publish),
        "prototype: layered step+copy": (set_proto_grads, layered_step_and_copy),
    }
    try:
        timings = run_rounds(variants, rounds)
        rp.synchronize()
    finally:
        busy.close()
        rp.close()
        if shared is not None:
            shared.close()
        copier.shutdown()
    rows: list[Row] = [(name, *t) for name, t in timings.items()]
    skip = len(thread_wall) - rounds  # the warm-up round's step
    rows.insert(
        len(rows) - 2,
        (
            "async: optimizer thread",
            Timing("", thread_wall[skip:]),
            Timing("", thread_cpu[skip:]),
            thread_faults[skip:],
        ),
    )
    return rows


def table(rows: list[Row]) -> str:
    width = max(len(r[0]) for r in rows) + 2
    base_wall, base_cpu = rows[0][1].median_ms, rows[0][2].median_ms
    lines = [
        f"{'':<{width}}{'wall ms':>9}{'p25..p75':>15}{'/ fused':>9}"
        f"{'cpu ms':>9}{'p25..p75':>15}{'/ fused':>9}{'faults':>9}"
    ]
    for name, wall, cpu, faults in rows:
        row = f"{name:<{width}}"
        for t, base in ((wall, base_wall), (cpu, base_cpu)):
            lo, hi = t.spread_ms
            row += f"{t.median_ms:>9.1f}{f'{lo:.1f}..{hi:.1f}':>15}{t.median_ms / base:>9.2f}"
        row += f"{statistics.median(faults):>9.0f}"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params", type=str, default="20e6,100e6", help="sizes, comma-separated")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", type=str, default="fp32,bf16", help="weight dtypes: fp32,bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [float(s) for s in args.params.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    print(
        f"{args.rounds} rounds, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        "ratios are medians over the fused AdamW baseline's"
    )
    for size in sizes:
        for d in dtypes:
            layers = max(1, round(size / (args.width * args.width + args.width)))
            n = layers * (args.width * args.width + args.width)
            print(f"\n{n / 1e6:.1f}M parameters ({layers} layers), {d} weights, fp32 masters")
            print(table(bench(size, args.width, DTYPES[d], args.rounds)), flush=True)


if __name__ == "__main__":
    main()
