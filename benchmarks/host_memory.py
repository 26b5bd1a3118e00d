"""Host memory of RoundPipe runs, measured against the budget and against plain PyTorch.

Each measurement runs in a fresh subprocess (``--child ...``) that reports the
peak resident set size (``VmHWM`` from ``/proc/self/status``; the peak is reset
between phases through ``/proc/self/clear_refs``). Peaks are counted from the
RSS of the process before the model is built (the Python/torch runtime itself
is not the run's state). Configurations alternate round by round; the report
gives the median and the spread (min..max) over rounds.

Two parts:

* ``budget``: the peak of ``forward_backward`` + ``step`` training on the core
  engine (2 CPU workers, AdamW) vs ``estimate_host_memory``'s prediction, for
  an fp32 and a bf16 model (fp32 masters), and the bytes per parameter next to
  plain PyTorch training the same model with the same optimizer.
* ``lightning``: the peak RSS of the *whole process* (interpreter, torch and
  Lightning included) training the fp32 model through Lightning, in bytes per
  parameter: ``RoundPipeStrategy(async_step=False)`` (the parameters are their
  own masters), ``async_step=True`` (separate fp32 masters) and Lightning's
  default strategy with a plain ``loss.backward()``.
* ``checkpoint``: through Lightning, the peak while saving a checkpoint and
  while resuming from it, each divided by the training peak of the same
  process, with the strategy's ``StreamingCheckpointIO`` and with Lightning's
  ``TorchCheckpointIO``.

Run (Linux; a ~150M-parameter model needs ~8 GB of free RAM; ~10 minutes on 2 cores):

    python benchmarks/host_memory.py                       # all parts, 3 rounds
    python benchmarks/host_memory.py --part budget --rounds 1 --width 512  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["main"]

GiB = 1024**3


# -- measurement helpers (child side) ---------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _rss() -> int:
    return _status("VmRSS")


def _peak() -> int:
    return _status("VmHWM")


def _reset_peak() -> None:
    # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _build(width: int, blocks: int, dtype: str) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        """A transformer-sized MLP block (most of an LLM layer's parameters)."""

        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

    torch.manual_seed(0)
    net = nn.Sequential(*[Block() for _ in range(blocks)])
    if dtype == "bf16":
        net = net.to(torch.bfloat16)
    return net


def _data(width: int, dtype: str) -> Any:
    import torch

    g = torch.Generator().manual_seed(1)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    return torch.randn(24, width, generator=g).to(dt), torch.randn(24, width, generator=g).to(dt)


def _loss(out: Any, y: Any) -> Any:
    return ((out.float() - y.float()) ** 2).mean()


#: Trainer options of the Lightning children: nothing but the training and its memory
_QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def _lit_class(width: int, blocks: int, plain: bool = False) -> Any:
    """The LightningModule the Lightning children train: the fp32 model, AdamW; its
    training_step calls ``self.roundpipe`` (``plain``: the network, for Lightning's
    default strategy)."""
    import lightning as L
    import torch

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _build(width, blocks, "fp32")

        def configure_sequential(self) -> Any:
            return self.net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            if plain:
                return _loss(self.net(x), y)
            return self.roundpipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Lit


def child_core(width: int, blocks: int, dtype: str, steps: int) -> dict[str, Any]:
    """Core engine training vs the budget estimated before it starts."""
    import torch

    from roundpipe_core import OptimizerCtx, RoundPipe
    from roundpipe_core.running.host_memory import estimate_host_memory

    base = _rss()
    _reset_peak()
    net = _build(width, blocks, dtype)
    rp = RoundPipe(net, optim_dtype=torch.float32, devices="cpu:2")
    with OptimizerCtx():
        opt = torch.optim.AdamW(rp.parameters(), lr=1e-4)
    budget = estimate_host_memory(rp, optimizer=opt, num_microbatch=3, async_step=False)
    x, y = _data(width, dtype)
    for _ in range(steps):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        rp.step(step, is_async=False)
    rp.synchronize()
    peak = _peak() - base
    n = budget.num_params
    out = {
        "params": n,
        "measured": peak,
        "predicted": budget.total,
        "ratio": peak / budget.total,
        "bpp": peak / n,
        "table": str(budget),
    }
    rp.close()
    return out


def child_plain(width: int, blocks: int, dtype: str, steps: int) -> dict[str, Any]:
    """Plain PyTorch: the same model, AdamW on the model's own parameters."""
    import torch

    base = _rss()
    _reset_peak()
    net = _build(width, blocks, dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x, y = _data(width, dtype)
    for _ in range(steps):
        _loss(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    n = sum(p.numel() for p in net.parameters())
    peak = _peak() - base
    return {"params": n, "measured": peak, "bpp": peak / n}


def child_lightning_train(width: int, blocks: int, variant: str, steps: int) -> dict[str, Any]:
    """Peak RSS of this whole process training the fp32 model through Lightning.

    ``variant``: "sync" (``RoundPipeStrategy(async_step=False)``), "async"
    (``async_step=True``) or "plain" (Lightning's default strategy, ``loss.backward()``).
    """
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from roundpipe_core.running.host_memory import estimate_host_memory
    from roundpipe_lightning import RoundPipeStrategy

    Lit = _lit_class(width, blocks, plain=variant == "plain")

    predicted: dict[str, int] = {}

    class Budget(L.Callback):
        """What the strategy's setup budgets (a plain run: the module's own state)."""

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            target = pl_module.net if variant == "plain" else pl_module.roundpipe
            budget = estimate_host_memory(
                target,
                optimizer=list(trainer.optimizers),
                shared_masters=True,
                async_step=variant == "async",
            )
            predicted["total"] = budget.total

    x, y = _data(width, "fp32")
    data = DataLoader(TensorDataset(x.repeat(4, 1), y.repeat(4, 1)), batch_size=24)
    runtime = _rss()  # interpreter + torch + Lightning, before the model exists
    if variant == "plain":
        kw: dict[str, Any] = {"devices": 1}
    else:
        kw = {
            "devices": 2,
            "strategy": RoundPipeStrategy(num_microbatch=3, async_step=variant == "async"),
        }
    module = Lit()
    n = sum(p.numel() for p in module.parameters())
    L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        **_QUIET,
        callbacks=[Budget()],
        **kw,
    ).fit(module, data)
    peak = _peak()
    return {
        "params": n,
        "peak": peak,
        "bpp": peak / n,
        "runtime": runtime,
        "state_bpp": (peak - runtime) / n,
        "ratio": (peak - runtime) / predicted["total"],
    }


def child_lightning(
    width: int, blocks: int, dtype: str, steps: int, io: str, ckpt: str
) -> dict[str, Any]:
    """Train, save (peak of the save / training peak), then in a fresh Trainer resume
    from the file (peak of setup + restore / training peak)."""
    import lightning as L
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from roundpipe_lightning import RoundPipeStrategy

    # "fp32-async": the fp32 model with RoundPipeStrategy(async_step=True)
    is_async = dtype.endswith("-async")
    dtype = dtype.removesuffix("-async")
    Lit = _lit_class(width, blocks)

    peaks: dict[str, int] = {}

    class Phases(L.Callback):
        """Training peak up to the last step, then the peak of a checkpoint saved there
        (where ModelCheckpoint saves: all training state alive); on resume, the peak of
        setup + restore up to the first step."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            peaks.setdefault("restore", _peak() - base)
            _reset_peak()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == steps and "train" not in peaks:
                # an overlapped (async_step=True) iteration may still be running: its
                # peak is training's, not the save's
                pl_module.roundpipe.synchronize()
                peaks["train"] = _peak() - base
                _reset_peak()
                trainer.save_checkpoint(ckpt)
                peaks["save"] = _peak() - base

    x, y = _data(width, "fp32")
    data = DataLoader(TensorDataset(x.repeat(4, 1), y.repeat(4, 1)), batch_size=24)

    def trainer(max_steps: int) -> L.Trainer:
        kw: dict[str, Any] = {} if io == "streaming" else {"checkpoint_io": TorchCheckpointIO()}
        return L.Trainer(
            strategy=RoundPipeStrategy(num_microbatch=3, async_step=is_async, **kw),
            accelerator="cpu",
            devices=2,
            precision="bf16-true" if dtype == "bf16" else "32-true",
            max_steps=max_steps,
            **_QUIET,
            callbacks=[Phases()],
        )

    base = _rss()
    _reset_peak()
    t = trainer(steps)
    t.fit(Lit(), data)
    train_peak, save_peak = peaks["train"], peaks["save"]
    del t
    import gc

    gc.collect()
    peaks.clear()
    _reset_peak()
    # the restore phase: a new module + RoundPipe, then the checkpoint, up to the first step
    trainer(steps + 2).fit(Lit(), data, ckpt_path=ckpt)
    return {
        "train": train_peak,
        "save": save_peak,
        "restore": peaks["restore"],
        "save_ratio": save_peak / train_peak,
        "load_ratio": peaks["restore"] / train_peak,
    }


def child_matmul(size: int, seconds: float) -> dict[str, Any]:
    """Single-thread matmul throughput in fp32 and bf16 (GFLOP/s) under this process's
    oneDNN ISA cap (``ONEDNN_MAX_CPU_ISA``), and whether oneDNN has bf16 kernels."""
    import time

    import torch

    torch.set_num_threads(1)
    out: dict[str, Any] = {
        "isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "native"),
        "bf16_kernels": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(size, size).to(dt), torch.randn(size, size).to(dt)
        a @ b
        k, start = 0, time.perf_counter()
        while True:
            a @ b
            k += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds and k >= 2:
                break
        out[name] = 2 * size**3 * k / elapsed / 1e9
    return out


# -- driver ------------------------------------------------------------------------------------------
def _run_child(args: list[str], extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(extra_env or {})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(values: list[float], fmt: str = "{:.3f}") -> str:
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def _precision(rounds: int) -> None:
    """bf16 vs fp32 matmul speed on this CPU as it is, and with oneDNN capped to the
    instruction sets of CPUs without bf16 support (AVX512 without BF16; AVX2 only)."""
    caps = ["native", "AVX512_CORE", "AVX2"]
    res: dict[str, list[dict[str, Any]]] = {c: [] for c in caps}
    for _ in range(rounds):
        for cap in caps:
            env = {} if cap == "native" else {"ONEDNN_MAX_CPU_ISA": cap}
            res[cap].append(_run_child(["--child", "matmul", "1024", "1.0"], env))
    print("\n== matmul 1024x1024, one thread: bf16 speed / fp32 speed ==")
    print(
        f"{'oneDNN ISA':12} {'bf16 kernels':>12} {'fp32 GFLOP/s':>14} {'bf16 GFLOP/s':>14} {'bf16 / fp32':>22}"
    )
    for cap, rows in res.items():
        print(
            f"{cap:12} {str(rows[0]['bf16_kernels']):>12} {statistics.median(r['fp32'] for r in rows):14.1f} "
            f"{statistics.median(r['bf16'] for r in rows):14.2f} {_summary([r['bf16'] / r['fp32'] for r in rows]):>22}"
        )


_LIGHTNING_VARIANTS = {
    "sync": "RoundPipeStrategy(async_step=False)",
    "async": "RoundPipeStrategy(async_step=True)",
    "plain": "Lightning default strategy",
}


def _lightning_rows(common: list[str], rounds: int) -> None:
    """Whole-process peak RSS per parameter through Lightning, the variants interleaved
    round by round (a fresh process each)."""
    res: dict[str, list[dict[str, Any]]] = {v: [] for v in _LIGHTNING_VARIANTS}
    for _ in range(rounds):
        for variant in _LIGHTNING_VARIANTS:
            res[variant].append(_run_child([*common, "--child", "lightning_train", variant]))
    n = res["sync"][0]["params"]
    print(f"\n== fp32 model through Lightning, AdamW, {n:,} params: whole-process peak RSS ==")
    print(
        f"{'strategy':38} {'peak GiB':>9} {'B/param':>20} {'above runtime B/param':>24} "
        f"{'above runtime / budget':>24}"
    )
    for variant, rows in res.items():
        print(
            f"{_LIGHTNING_VARIANTS[variant]:38} {statistics.median(r['peak'] for r in rows) / GiB:9.2f} "
            f"{_summary([r['bpp'] for r in rows], '{:.1f}'):>20} "
            f"{_summary([r['state_bpp'] for r in rows], '{:.1f}'):>24} "
            f"{_summary([r['ratio'] for r in rows]):>24}"
        )
    sync, plain = res["sync"], res["plain"]
    ratios = [s["peak"] / p["peak"] for s, p in zip(sync, plain)]
    print(f"sync RoundPipe peak / plain Lightning peak (per round): {_summary(ratios)}")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run the requested parts (or one child measurement)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--part", choices=["budget", "lightning", "checkpoint", "precision", "all"], default="all"
    )
    p.add_argument(
        "--width", type=int, default=1536, help="block width (1536 x 8 blocks ~ 151M params)"
    )
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        kind, dtype = a.child[0], a.child[1] if len(a.child) > 1 else ""
        if kind == "matmul":
            out = child_matmul(int(a.child[1]), float(a.child[2]))
        elif kind == "core":
            out = child_core(a.width, a.blocks, dtype, a.steps)
        elif kind == "plain":
            out = child_plain(a.width, a.blocks, dtype, a.steps)
        elif kind == "lightning_train":
            out = child_lightning_train(a.width, a.blocks, dtype, a.steps)
        else:
            out = child_lightning(a.width, a.blocks, dtype, a.steps, a.child[2], a.child[3])
        print(json.dumps(out))
        return
    if a.part in ("precision", "all"):
        _precision(a.rounds)
    common = ["--width", str(a.width), "--blocks", str(a.blocks), "--steps", str(a.steps)]
    if a.part in ("budget", "all"):
        res: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(a.rounds):
            for dtype in ("fp32", "bf16"):
                for kind in ("core", "plain"):
                    res.setdefault((kind, dtype), []).append(
                        _run_child([*common, "--child", kind, dtype])
                    )
        for dtype in ("fp32", "bf16"):
            core, plain = res[("core", dtype)], res[("plain", dtype)]
            print(
                f"\n== {dtype} model, fp32 masters, AdamW, 2 CPU workers, {core[0]['params']:,} params =="
            )
            print(core[0]["table"])
            print(f"measured peak / predicted : {_summary([r['ratio'] for r in core])}")
            print(
                f"measured peak             : {_summary([r['measured'] / GiB for r in core], '{:.2f}')} GiB"
            )
            print(f"RoundPipe bytes/param     : {_summary([r['bpp'] for r in core], '{:.1f}')}")
            print(f"plain PyTorch bytes/param : {_summary([r['bpp'] for r in plain], '{:.1f}')}")
    if a.part in ("lightning", "all"):
        _lightning_rows(common, a.rounds)
    if a.part in ("checkpoint", "all"):
        ck: dict[tuple[str, str], list[dict[str, Any]]] = {}
        with tempfile.TemporaryDirectory() as d:
            for r in range(a.rounds):
                for dtype in ("fp32", "fp32-async", "bf16"):
                    for io in ("streaming", "torch"):
                        path = os.path.join(d, f"{dtype}-{io}-{r}.ckpt")
                        ck.setdefault((dtype, io), []).append(
                            _run_child([*common, "--child", "lightning", dtype, io, path])
                        )
                        os.unlink(path)
        print("\n== Lightning checkpoints: peak / training peak of the same process ==")
        print(
            f"{'model':6} {'CheckpointIO':14} {'train GiB':>10} {'save / train':>22} {'resume / train':>22}"
        )
        for (dtype, io), rows in ck.items():
            name = "Streaming" if io == "streaming" else "TorchCheckpointIO"
            print(
                f"{dtype:6} {name:14} {statistics.median(r['train'] for r in rows) / GiB:10.2f} "
                f"{_summary([r['save_ratio'] for r in rows]):>22} {_summary([r['load_ratio'] for r in rows]):>22}"
            )


if __name__ == "__main__":
    main()
