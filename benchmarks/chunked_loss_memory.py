"""Peak host memory of a preset's loss with and without the full logits (CPU).

    python benchmarks/chunked_loss_memory.py [--tokens 2048] [--hidden 1024]
        [--vocab 151936] [--chunk-tokens 1024] [--rounds 3]

What is measured: the last pipeline layer of a converted causal LM (final norm,
LM head, loss -- ``CausalLMOutputAdapter``, the layer ``return_logits`` acts
on), forward + backward of ``out.loss`` for one microbatch of ``--tokens``
tokens, once with ``return_logits=True`` (the full ``(tokens, vocab)`` logits,
Hugging Face's way) and once with ``return_logits=False`` (chunked linear +
cross-entropy straight from the hidden states and the LM-head weight). The
default shape is Qwen3's 151,936-token vocabulary at 2K tokens.

How: torch's allocations are invisible to ``tracemalloc``, so every variant
runs in its own fresh subprocess and reports its resident-set high-water
mark (``ru_maxrss``) minus its RSS after setup (weights, inputs and their
gradient buffers allocated and touched once), i.e. the extra memory the step
itself needed. Variants alternate order round by round (interleaved), and the
table gives the median and the spread (min..max) over rounds, the ratio of the
medians, and checks that both variants computed the same loss.

Measured with the defaults on a shared 2-core CPU machine (3 rounds):
peak extra RSS 4771 MiB (full logits) vs 1224 MiB (chunked), 3.90x less;
the chunked loss took 1.20x the time (its backward recomputes each chunk's
logits: one extra LM-head matmul); identical loss (12.0925).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

__all__ = ["main"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from roundpipe_core.presets.head import CausalLMOutputAdapter

    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    norm = nn.LayerNorm(args.hidden)
    adapter = CausalLMOutputAdapter(norm, head, loss_chunk_tokens=args.chunk_tokens)
    hidden = torch.randn(1, args.tokens, args.hidden, requires_grad=True)
    labels = torch.randint(0, args.vocab, (1, args.tokens))
    # the gradients the step will write, allocated up front so both variants start equal
    for p in (head.weight, hidden):
        p.grad = torch.zeros_like(p)
    extras = {
        "return_logits": args.variant == "full",
        "logits_to_keep": 0,
        "num_items_in_batch": None,
        "output_router_logits": False,
        "router_stats": None,
    }
    state = (hidden, None, None, None, None, labels, extras)
    base = _rss_bytes()
    t0 = time.perf_counter()
    out = adapter(*state)
    out.loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(
        json.dumps(
            {"peak_extra": peak - base, "seconds": seconds, "loss": float(out.loss.detach())}
        )
    )


def _run(variant: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--tokens",
        str(args.tokens),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--chunk-tokens",
        str(args.chunk_tokens),
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{variant} run failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _fmt(values: list[float], scale: float, unit: str) -> str:
    med = statistics.median(values) / scale
    return f"{med:8.1f} {unit} ({min(values) / scale:.1f}..{max(values) / scale:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.variant = args.child
        _child(args)
        return

    results: dict[str, list[dict]] = {"full": [], "chunked": []}
    for r in range(args.rounds):
        order = ["full", "chunked"] if r % 2 == 0 else ["chunked", "full"]
        for variant in order:
            results[variant].append(_run(variant, args))
    mib = 2**20
    logits_mib = args.tokens * args.vocab * 4 / mib
    print(
        f"LM head + loss, forward+backward, {args.tokens} tokens, hidden {args.hidden}, vocab "
        f"{args.vocab} (fp32 logits alone: {logits_mib:.0f} MiB), chunk {args.chunk_tokens} tokens, "
        f"{args.rounds} interleaved rounds, one fresh process per run"
    )
    print(f"{'variant':<28} {'peak extra RSS: median (min..max)':<36} time: median (min..max)")
    for variant, label in (("full", "return_logits=True"), ("chunked", "return_logits=False")):
        runs = results[variant]
        print(
            f"{label:<28} {_fmt([x['peak_extra'] for x in runs], mib, 'MiB'):<36} "
            f"{_fmt([x['seconds'] for x in runs], 1e-3, 'ms')}"
        )
    full = statistics.median(x["peak_extra"] for x in results["full"])
    chunked = statistics.median(x["peak_extra"] for x in results["chunked"])
    t_full = statistics.median(x["seconds"] for x in results["full"])
    t_chunked = statistics.median(x["seconds"] for x in results["chunked"])
    print(
        f"peak extra memory ratio full/chunked: {full / chunked:.2f}x; "
        f"time ratio chunked/full: {t_chunked / t_full:.2f}x"
    )
    losses = {round(x["loss"], 4) for v in results.values() for x in v}
    diff = max(x["loss"] for v in results.values() for x in v) - min(
        x["loss"] for v in results.values() for x in v
    )
    print(f"loss (all runs): {sorted(losses)} (max difference {diff:.2e})")


if __name__ == "__main__":
    main()
