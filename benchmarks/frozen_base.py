"""LoRA on a frozen base read from its safetensors files: the base stays in the file's
pages (``from_pretrained`` keeps a bf16 checkpoint loaded in bf16 mapped; RoundPipe with
``pin_model="off"`` copies none of it), so the run's resident set is the adapters' state,
the activations and the process -- a memory cap below the model's size still trains.

A child process (as root: in a fresh cgroup-v1 memory cgroup with
``memory.limit_in_bytes`` = ``--cap-gib``, joined before torch is imported; ``--cap-gib
0``: no cap) loads the checkpoint, adds LoRA (r=16, all attention and MLP projections),
wraps it with ``pin_model="off"`` on CPU workers, makes the budget and trains
``--steps`` steps while a thread samples ``/proc/self/status`` every 5 ms. The parent
first drops the checkpoint's pages from the page cache (``posix_fadvise(DONTNEED)``), so
the child reads -- and its cgroup is charged for -- every page itself. Printed: the
base's bytes, the cap, the peaks of ``RssAnon`` and ``RssFile`` and the cgroup's peak
usage (page cache included), the budget's anonymous and file-backed parts, the step
times and the losses.

    python benchmarks/frozen_base.py --model-dir /tmp/llama-850m --make      # once
    python benchmarks/frozen_base.py --model-dir /tmp/llama-850m --cap-gib 1.0
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from disk_tier import make_memory_cgroup


def make(args: argparse.Namespace) -> None:
    """A random bf16 Llama of the given shape, saved with ``save_pretrained``."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(args.hidden // 512, 1),
        vocab_size=args.vocab,
        tie_word_embeddings=False,
        use_cache=False,
        dtype=torch.bfloat16,
    )
    with torch.device("cpu"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.model_dir)
    print(f"saved {sum(p.numel() for p in model.parameters()):,} parameters to {args.model_dir}")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


class _Peaks:
    """Highest ``RssAnon``/``RssFile``/``VmRSS`` seen, sampled every 5 ms."""

    def __init__(self) -> None:
        self.peak = _status()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.005):
            now = _status()
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def stop(self) -> dict[str, int]:
        self._done.set()
        self._thread.join()
        return self.peak


def child(args: argparse.Namespace) -> None:
    if args.cgroup:  # before torch: everything the process maps or allocates is charged
        with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    import peft
    import torch
    import transformers as tf

    from roundpipe_core import wrap_model_to_roundpipe
    from roundpipe_core.presets import causal_lm_loss_fn
    from roundpipe_core.running.host_memory import estimate_host_memory, mapped_file_bytes

    imported = _status()
    model = tf.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = peft.get_peft_model(
        model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0)
    )
    base = [p for p in pm.parameters() if not p.requires_grad]
    base_bytes = sum(p.nbytes for p in base)
    rp = wrap_model_to_roundpipe(
        pm, devices=args.devices, optim_dtype=torch.float32, pin_model="off"
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens))
    loss_fn = causal_lm_loss_fn(ids)
    peaks = _Peaks()
    losses, times = [], []
    budget = None
    for k in range(args.steps):
        t0 = time.perf_counter()
        loss = rp.forward_backward(input_kwargs={"input_ids": ids}, label=ids, loss_fn=loss_fn)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(f"step {k}: loss {losses[-1]:.4f}, {times[-1]:.1f} s", file=sys.stderr, flush=True)
        if budget is None:  # after the first call measured the activations
            budget = estimate_host_memory(rp, optimizer=opt)
    peak = peaks.stop()
    assert budget is not None
    still_mapped = mapped_file_bytes(base).inside
    rp.close()
    mib = 2**20
    print(
        json.dumps(
            {
                "params": sum(p.numel() for p in pm.parameters()),
                "base_bytes": base_bytes,
                "base_still_mapped_bytes": still_mapped,
                "rss_after_imports_MiB": {k: v / mib for k, v in imported.items()},
                "peak_MiB": {k: v / mib for k, v in peak.items()},
                "peak_anon_over_imports_MiB": (peak["RssAnon"] - imported["RssAnon"]) / mib,
                "budget_MiB": {
                    "total": budget.total / mib,
                    "file_backed": budget.file_backed / mib,
                    "anonymous": budget.anonymous / mib,
                    "process": budget.process / mib,
                    "process_peak": budget.process_peak / mib,
                },
                "losses": losses,
                "s_per_step": times,
            },
            indent=1,
        )
    )
    print(budget, file=sys.stderr)


def _drop_page_cache(model_dir: str) -> None:
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def parent(args: argparse.Namespace) -> None:
    _drop_page_cache(args.model_dir)
    cap = int(args.cap_gib * 2**30)
    path = make_memory_cgroup(cap, "roundpipe-frozen") if cap else ""
    cmd = [sys.executable, __file__, "--child", "--cgroup", path, *sys.argv[1:]]
    result: dict[str, Any] = {"cap_bytes": cap}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if path:
            for name in ("max_usage_in_bytes", "failcnt"):
                with open(os.path.join(path, f"memory.{name}")) as f:
                    result[f"cgroup_{name}"] = int(f.read())
    finally:
        if path:
            try:
                os.rmdir(path)
            except OSError:
                pass
    print(proc.stderr[-4000:])
    print(proc.stdout.strip())
    result["child_returncode"] = proc.returncode
    print(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--make", action="store_true", help="save a random model there first")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--cap-gib", type=float, default=1.0, help="0: no cap")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="rows of one sequence per step")
    ap.add_argument("--devices", default="cpu:2")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make:
        make(args)
    elif args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
