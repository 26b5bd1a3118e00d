"""A real-size Hugging Face model on CPU workers: RoundPipe's defaults against plain HF.

    python benchmarks/hf_real_size.py [--rounds 3] [--steps 2] [--layers 28] [--seq 256]
                                      [--batch 2] [--threads 2] [--variants hf,rp,...]
    python benchmarks/hf_real_size.py --variants "rp,rp structure" --rounds 5
        # a family converted by structure against its preset (issue 36, item 5)

A Qwen3-0.6B-shaped ``Qwen3ForCausalLM`` built from a config (hidden 1024, 28 decoder
layers, MLP 3072, 16 heads / 8 KV heads of 128, vocabulary 151936, tied embeddings;
random weights, nothing downloaded), fp32, ``--batch`` sequences of ``--seq`` random
tokens, AdamW. Every variant runs in a process of its own (so that its peak RSS is its
own), one process per variant and round, the variants alternating round by round:

* ``hf``: ``model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()``;
* ``hf ckpt``: the same with ``model.gradient_checkpointing_enable()``;
* ``rp``: ``wrap_model_to_roundpipe(model, devices="cpu:2")`` with every default
  (its plan, its microbatches, its masters and step), ``forward_backward`` with
  ``causal_lm_loss_fn``, AdamW over ``optim_parameters()``, ``rp.step(...)``;
* ``rp structure``: the same, but the model converted by the converter by structure
  (``convert_decoder_lm``, as for a family without a preset) instead of the Qwen3
  preset, then ``RoundPipe(seq, original_model=model, devices="cpu:2")`` as
  ``wrap_model_to_roundpipe`` builds it.

``--variants`` picks which run (in that order each round); ratios are to the first.

Printed per variant: the median time of a training step after the first (warm-up)
one, the whole process's wall time, the process's peak RSS, each with [min..max]
over rounds, and their ratios to the first variant per round (median and range); then the step-0
losses of every run, which must agree (the same arithmetic on the same weights).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("hf", "hf ckpt", "rp", "rp structure")


def _config(args: argparse.Namespace):  # noqa: ANN202 - transformers is optional
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max(512, args.seq),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def child(args: argparse.Namespace) -> None:
    """One variant in this process: print one JSON line with its measurements."""
    t_start = time.perf_counter()
    import torch
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config(args)).float()
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    times, losses = [], []
    if args.child in ("hf", "hf ckpt"):
        if args.child == "hf ckpt":
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for _ in range(args.steps + 1):
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    else:
        from roundpipe_core import wrap_model_to_roundpipe
        from roundpipe_core.presets import causal_lm_loss_fn

        model.config.use_cache = False
        if args.child == "rp":
            rp = wrap_model_to_roundpipe(model, devices="cpu:2")
        else:  # what wrap_model_to_roundpipe builds for a family without a preset
            from roundpipe_core import RoundPipe
            from roundpipe_core.presets import convert_decoder_lm

            rp = RoundPipe(
                convert_decoder_lm(model),
                original_model=model,
                devices="cpu:2",
                name=type(model).__name__,
            )
        opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-5)
        try:
            for _ in range(args.steps + 1):
                t0 = time.perf_counter()
                loss = rp.forward_backward(
                    input_kwargs={"input_ids": ids}, label=ids, loss_fn=causal_lm_loss_fn(ids)
                )
                rp.step(lambda: (opt.step(), opt.zero_grad()))
                rp.synchronize()
                times.append(time.perf_counter() - t0)
                losses.append(float(loss))
            plan = str(rp.plan_for("fused"))
        finally:
            rp.close()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out = {
        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "process_s": time.perf_counter() - t_start,
        "peak_rss_gib": peak_kib / 1024**2,
        "loss0": losses[0],
        "plan": plan if args.child.startswith("rp") else "",
    }
    print("RESULT " + json.dumps(out), flush=True)


def _run_child(variant: str, argv: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", variant, *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant!r} failed:\n{proc.stdout}\n{proc.stderr}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    out["process_s"] = time.perf_counter() - t0  # the whole process, interpreter start included
    return out


def _range(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} [{min(values):.2f}..{max(values):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every variant")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}"
    )
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    base = variants[0]
    argv = [
        f"--{k}={getattr(args, k)}"
        for k in ("steps", "layers", "hidden", "intermediate", "vocab", "seq", "batch", "threads")
    ]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            runs[v].append(_run_child(v, argv))
            print(f"round {r + 1}/{args.rounds} {v}: {runs[v][-1]}", file=sys.stderr, flush=True)
    print(
        f"Qwen3-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, "
        f"batch {args.batch} x seq {args.seq}, AdamW, torch threads {args.threads}; "
        f"{args.rounds} rounds, one process per variant and round, medians [min..max]"
    )
    for v in variants:
        if runs[v][0]["plan"]:
            print(f"{v} plan: {runs[v][0]['plan']}")
    header = (
        f"{'variant':12} {'step s':>22} {'process s':>22} {'peak RSS GiB':>22} "
        f"{'step / ' + base:>22} {'process / ' + base:>22} {'RSS / ' + base:>22}"
    )
    print(header)
    for v in variants:
        cols = [_range([x[k] for x in runs[v]]) for k in ("step_s", "process_s", "peak_rss_gib")]
        ratios = [
            _range([x[k] / h[k] for x, h in zip(runs[v], runs[base])])
            for k in ("step_s", "process_s", "peak_rss_gib")
        ]
        print(f"{v:12} " + " ".join(f"{c:>22}" for c in cols + ratios))
    losses = {v: [x["loss0"] for x in runs[v]] for v in variants}
    print("step-0 losses: " + ", ".join(f"{v} {sorted(set(ls))}" for v, ls in losses.items()))


if __name__ == "__main__":
    main()
