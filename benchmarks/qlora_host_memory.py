"""Host memory of a QLoRA run: the budget's prediction for Llama-3.1-8B / 70B, and the
budget against the measured whole-process peak on a 4-bit model that fits this machine.

Two parts:

* ``table``: Llama-3.1-8B and -70B built on the meta device from their config numbers
  (no weights), their linears laid out as bitsandbytes' NF4 with double quantization
  (``roundpipe_core.running.meta_quant.quantize_on_meta``: the packed bytes and quant
  state real quantization gives, without quantizing), LoRA r=16 on every projection,
  and ``estimate_host_memory`` on it: AdamW on fp32 masters with the asynchronous step
  (a GPU pool's default), ``--table-microbatches`` microbatches of one row of
  ``--table-seq`` tokens with a bf16 hidden state kept per decoder layer and microbatch.
  ``tests/presets/test_qlora_meta.py`` checks that the budget of a meta model equals the
  budget of the same model loaded quantized, and ``measure`` checks it again at 0.5 / 1.2 B.
* ``measure``: a Llama-3-shaped model (``--shape 0.5b``: 0.51 B parameters; ``1b``:
  Llama-3.2-1B's shape, 1.25 B) is built from a config and saved in bf16 (one
  subprocess; ``--model-dir`` keeps it for the next run), then reloaded in NF4 by
  bitsandbytes, given LoRA r=16 on every projection, wrapped with
  ``wrap_model_to_roundpipe`` on 2 CPU workers, budgeted (``estimate_host_memory`` before
  the first step, with the activations measured on one microbatch) and trained for
  ``--steps`` steps (another subprocess, ``--heap``: glibc's default ``malloc``,
  ``MALLOC_MMAP_THRESHOLD_=65536``, or ``limit_heap_retention()``). Reports the budget
  line by line, the whole process's RSS by phase and its training peak (``VmHWM``)
  against the budget's ``process_peak``.

Run (needs ~5 GB free RAM for ``1b`` and ~3 GB of disk; 1-2 minutes per run on 2 cores):

    python benchmarks/qlora_host_memory.py --part table
    python benchmarks/qlora_host_memory.py --part measure --shape 1b --heap mmap65536 \\
        --model-dir /tmp/llama1b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

GiB = 2**30


@dataclass
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False


LLAMA_8B = Shape("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256)
LLAMA_70B = Shape("Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128256)
# measured here: Llama-3-shaped, ~0.55 B parameters
SMALL = Shape("Llama-3-shaped 0.55B", 1536, 4096, 16, 12, 4, 32000)
# measured here: Llama-3.2-1B's shape (tied embeddings), 1.24 B parameters
LLAMA_1B = Shape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, tied=True)
SHAPES = {"0.5b": SMALL, "1b": LLAMA_1B}


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def meta_qlora(s: Shape, lora_r: int = 16, double_quant: bool = True) -> tuple[Any, int]:
    """``s`` built on the meta device in bf16, its linears laid out as bitsandbytes' NF4
    (``quantize_on_meta``: the head stays bf16), LoRA r=``lora_r`` on every projection:
    (the peft model, the bytes of its bf16 checkpoint)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from roundpipe_core.running.meta_quant import quantize_on_meta

    # built in bf16 as from_pretrained(dtype=torch.bfloat16) builds it: buffers made in
    # fp32 on purpose (the rotary inv_freq) stay fp32, where .to(bfloat16) would cast them
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(_config(s))
    finally:
        torch.set_default_dtype(default)
    checkpoint = sum(p.numel() * p.element_size() for p in model.parameters())
    quantize_on_meta(model, quant_type="nf4", double_quant=double_quant)
    cfg = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=TARGETS, lora_dropout=0.0)
    return get_peft_model(model, cfg), checkpoint


def meta_budget(s: Shape, seq: int, microbatches: int) -> dict:
    """``estimate_host_memory`` of :func:`meta_qlora` for a GPU pool: AdamW on fp32 masters
    with the asynchronous step (the GPU default), ``microbatches`` of one row of ``seq``
    tokens, a bf16 hidden state kept per decoder layer boundary and microbatch (a stage
    per decoder layer: the most a plan keeps)."""
    import torch

    from roundpipe_core.running.host_memory import estimate_host_memory

    pm, checkpoint = meta_qlora(s)
    boundary = seq * s.hidden * 2 * s.layers
    budget = estimate_host_memory(
        pm,
        optimizer="adamw",
        optim_dtype=torch.float32,
        async_step=True,
        num_microbatch=microbatches,
        activation_bytes_per_microbatch=boundary,
    )
    kept = sum(
        p.numel() * p.element_size()
        for n, p in pm.named_parameters()
        if p.dtype == torch.bfloat16  # embeddings, head, norms: views of a mapped file
    )
    return {"budget": budget, "mapped_checkpoint": checkpoint - kept}


def table(seq: int, microbatches: int) -> None:
    print(
        f"| model | parameters | weights: NF4 base + quant state, bf16 embeddings/head/norms, "
        f"fp32 adapters | adapters: masters + gradients + next gradients + AdamW | "
        f"activations ({microbatches} x {seq} tokens) | **total host RAM** | "
        "+ mapped bf16 checkpoint (page cache, in RSS) |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in (LLAMA_8B, LLAMA_70B):
        r = meta_budget(s, seq, microbatches)
        b = r["budget"]
        adapters = b.masters + b.gradients + b.next_gradients + b.optimizer_state
        print(
            f"| {s.name} | {b.num_params / 1e9:.2f} B | {b.weights / GiB:.2f} GiB | "
            f"{adapters / GiB:.2f} GiB | {b.activations / GiB:.2f} GiB | "
            f"**{b.total / GiB:.2f} GiB** | {r['mapped_checkpoint'] / GiB:.1f} GiB |"
        )


def _config(s: Shape) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=s.tied,
        use_cache=False,
    )


def child_save(path: str, shape: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 1 B weights
    LlamaForCausalLM(_config(SHAPES[shape])).save_pretrained(path)
    return {}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class _Phases:
    """RSS at phase boundaries, and the peak within each phase (a 2 ms sampler thread;
    ``VmHWM`` catches what the sampler misses)."""

    def __init__(self) -> None:
        import threading

        self.name = "start"
        self.peak: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self.end_file: dict[str, int] = {}
        self.order: list[str] = []
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def file_backed(self) -> int:
        """Resident pages of mapped files (libraries, a mapped checkpoint) and shmem."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[2]) * self._page

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            r = self.rss()
            if r > self.peak.get(self.name, 0):
                self.peak[self.name] = r

    def enter(self, name: str) -> None:
        """End the current phase (its RSS now) and start ``name``."""
        self.end[self.name] = self.rss()
        self.end_file[self.name] = self.file_backed()
        self.peak[self.name] = max(self.peak.get(self.name, 0), self.end[self.name])
        self.order.append(self.name)
        self.name = name

    def close(self) -> list[tuple[str, int, int, int]]:
        self.enter("done")
        self._stop.set()
        self._thread.join()
        return [(n, self.peak[n], self.end[n], self.end_file[n]) for n in self.order]


def child_measure(path: str, steps: int, shape: str, heap: str, seq: int) -> dict:
    if heap == "limit":
        from roundpipe_core.running.host_memory import limit_heap_retention

        limit_heap_retention()
    phases = _Phases()
    import ctypes
    import gc

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from roundpipe_core import RoundPipeRunConfig, wrap_model_to_roundpipe
    from roundpipe_core.planning.profile import measure_activation_bytes
    from roundpipe_core.presets import causal_lm_loss_fn
    from roundpipe_core.running.host_memory import estimate_host_memory

    phases.enter("import bitsandbytes")
    import bitsandbytes  # noqa: F401  (its CPU library: counted apart from loading)

    s = SHAPES[shape]
    base_rss = _status("VmRSS")
    phases.enter("load NF4")
    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16)
    phases.enter("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=16, target_modules=targets, lora_dropout=0.0))
    model.train()
    phases.enter("gc + malloc_trim")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    loading_peak = _status("VmHWM")
    loaded_rss = _status("VmRSS")
    phases.enter("wrap")
    rp = wrap_model_to_roundpipe(
        model,
        optim_dtype=torch.float32,
        devices=2,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    phases.enter("optimizer")
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4)
    ids = torch.randint(0, s.vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    phases.enter("measure activations")
    # what the first training call measures, measured here so the budget has it before
    # the run: one microbatch (1 row) through the layers with autograd, loss included
    rp.layer_activation_bytes = measure_activation_bytes(
        rp.layers, input_ids=ids[:1], with_loss_transient=True
    )
    gc.collect()
    phases.enter("budget")
    budget = estimate_host_memory(rp, optimizer=opt)
    before_training = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here on: the training peak
    for i in range(steps):
        phases.enter(f"forward_backward {i}")
        rp.forward_backward(
            input_kwargs={"input_ids": ids}, label=ids, loss_fn=causal_lm_loss_fn(ids)
        )
        phases.enter(f"step {i}")
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        rp.synchronize()
    phases.enter("close")
    training_peak = _status("VmHWM")
    rp.close()
    table = phases.close()
    lines = {name: b for name, b in budget.rows()}
    return {
        "num_params": budget.num_params,
        "lines": lines,
        "budget": {
            "weights": budget.weights,
            "masters": budget.masters,
            "gradients": budget.gradients,
            "optimizer_state": budget.optimizer_state,
            "total": budget.total,
            "process": budget.process,
            "process_peak": budget.process_peak,
        },
        "plan": str(rp.plan_for("fused")),
        "base_rss": base_rss,
        "before_training": before_training,
        "training_peak": training_peak,
        "loading_peak": loading_peak,
        "loaded_rss": loaded_rss,
        "phases": table,
    }


def _child(*args: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


HEAPS = {
    "default": {},
    "mmap65536": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "limit": {},  # roundpipe_core.running.host_memory.limit_heap_retention() at start
}


def measure(steps: int, shape: str, heap: str, seq: int, model_dir: str | None) -> None:
    s = SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir or tmp
        if not os.path.exists(os.path.join(path, "config.json")):
            _child("save", path, shape)
        res = _child("measure", path, str(steps), shape, heap, str(seq), env=HEAPS[heap])
    b = res["budget"]
    meta = meta_budget(s, seq, 2)["budget"]
    mib = 2**20
    print(
        f"{s.name}: {res['num_params'] / 1e9:.3f} B parameters, NF4 + LoRA r=16, AdamW, "
        f"2 CPU workers, batch 2 x {seq} tokens, 2 microbatches, heap {heap}, plan {res['plan']}"
    )
    print("  the loaded model's budget against the same shape built on the meta device:")
    for key in ("weights", "gradients", "optimizer_state"):
        print(
            f"    {key:28s} loaded {b[key] / mib:9.1f} MiB   meta {getattr(meta, key) / mib:9.1f} MiB"
            f"   {'equal' if b[key] == getattr(meta, key) else 'DIFFERENT'}"
            f" ({b[key] - getattr(meta, key):+d} B)"
        )
    print("  the budget, before training, line by line (MiB):")
    for name, value in res["lines"].items():
        print(f"    {name:40s} {value / mib:9.1f}")
    print(f"    {'total':40s} {b['total'] / mib:9.1f}")
    print(f"    {'+ process':40s} {b['process'] / mib:9.1f}")
    print(f"    {'= process_peak (predicted)':40s} {b['process_peak'] / mib:9.1f}")
    print(f"  whole process, measured (MiB): RSS before loading {res['base_rss'] / mib:.1f}")
    print(f"    loading peak                 {res['loading_peak'] / mib:9.1f}")
    print(f"    after loading (gc, trim)     {res['loaded_rss'] / mib:9.1f}")
    print(f"    before training              {res['before_training'] / mib:9.1f}")
    print(f"    training peak                {res['training_peak'] / mib:9.1f}")
    print(f"  training peak / predicted = {res['training_peak'] / b['process_peak']:.3f}")
    print("  by phase (MiB):")
    for name, peak, end, file_backed in res["phases"]:
        print(
            f"    {name:24s} peak {peak / mib:9.1f}  end {end / mib:9.1f}"
            f"  (file-backed {file_backed / mib:7.1f})"
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "save":
            out = child_save(rest[0], rest[1])
        else:
            out = child_measure(rest[0], int(rest[1]), rest[2], rest[3], int(rest[4]))
        print(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["table", "measure", "all"], default="all")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--heap", choices=sorted(HEAPS), default="default")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--table-seq", type=int, default=4096)
    ap.add_argument("--table-microbatches", type=int, default=4)
    ap.add_argument("--model-dir", help="keep the saved bf16 model here (reused if present)")
    args = ap.parse_args()
    if args.part in ("table", "all"):
        table(args.table_seq, args.table_microbatches)
    if args.part in ("measure", "all"):
        measure(args.steps, args.shape, args.heap, args.seq, args.model_dir)


if __name__ == "__main__":
    main()
