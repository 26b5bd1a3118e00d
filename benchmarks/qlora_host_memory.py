"""Host memory of a QLoRA run: the budget's prediction, for Llama-3.1 shapes and
measured on a 4-bit model that fits this machine.

Two parts:

* ``table`` (no model is built): what ``estimate_host_memory`` predicts for
  Llama-3.1-8B and -70B with an NF4 base (double quantization) under LoRA r=16 on
  every linear of the decoder layers, AdamW on fp32 masters, on a GPU pool. The
  lines are computed from bitsandbytes' storage layout (0.5 B per packed weight, a
  uint8 absmax per block of 64 with an fp32 absmax per 256 blocks, code books),
  bf16 embeddings / head / norms, and the budget's rules for masters, gradients and
  optimizer state -- the same rules ``--part measure`` checks against
  ``estimate_host_memory`` on a real model (``lines match the budget``).
* ``measure``: a Llama-3-shaped model of about 0.55 B parameters is built from a
  config and saved (one subprocess), then reloaded in NF4 by bitsandbytes and
  trained for a few steps with LoRA on 2 CPU workers (another subprocess). Reports
  the budget's total, the whole process's peak RSS (``VmHWM``) minus its RSS before
  the model was loaded, and their ratio.

Run once (needs ~4 GB free RAM and ~3 GB of /tmp; a few minutes on 2 cores):

    python benchmarks/qlora_host_memory.py              # both parts
    python benchmarks/qlora_host_memory.py --part table
"""

from __future__ import annotations

import argparse
import json
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


def _linears(s: Shape) -> list[tuple[int, int]]:
    """(in, out) of every linear of one decoder layer."""
    head_dim = s.hidden // s.heads
    kv = s.kv_heads * head_dim
    return [
        (s.hidden, s.hidden),  # q
        (s.hidden, kv),  # k
        (s.hidden, kv),  # v
        (s.hidden, s.hidden),  # o
        (s.hidden, s.intermediate),  # gate
        (s.hidden, s.intermediate),  # up
        (s.intermediate, s.hidden),  # down
    ]


def nf4_bytes(n: int, double_quant: bool = True, block: int = 64) -> int:
    """Host bytes of one NF4 weight of ``n`` elements with its quant state."""
    blocks = -(-n // block)
    packed = -(-n // 2)
    if not double_quant:
        return packed + 4 * blocks + 16 * 4  # fp32 absmax, 16-entry code book
    # uint8 absmax, fp32 absmax per 256 of them, the 256-entry nested code, offset
    return packed + blocks + 4 * -(-blocks // 256) + 256 * 4 + 16 * 4 + 4


def predict(s: Shape, lora_r: int = 16, weight_bytes: int = 2, double_quant: bool = True) -> dict:
    """The budget's lines for an NF4 QLoRA run of ``s`` with AdamW (2 states) on fp32
    masters, GPU pool (no CPU worker copies; pinned slab rounding and activations not
    counted)."""
    lin = _linears(s)
    packed = s.layers * sum(nf4_bytes(i * o, double_quant) for i, o in lin)
    embed = s.vocab * s.hidden * weight_bytes * (1 if s.tied else 2)
    norms = (2 * s.layers + 1) * s.hidden * weight_bytes
    lora = s.layers * sum(lora_r * (i + o) for i, o in lin)
    lora_model = lora * 4  # peft keeps the adapters in fp32 over a quantized base
    masters = 4 * lora  # fp32 masters of the adapters
    weights = packed + embed + norms + lora_model
    params = (
        s.layers * sum(i * o for i, o in lin) + embed // weight_bytes + norms // weight_bytes + lora
    )
    return {
        "params": params,
        "weights": weights,
        "masters": masters,
        "gradients": masters,
        "optimizer_state": 2 * masters,
        "total": weights + 4 * masters,
    }


def table() -> None:
    print(
        "| model | parameters | weights: NF4 base, bf16 embeddings + head, fp32 adapters | adapter masters + gradients + AdamW | total host RAM |"
    )
    print("|---|---|---|---|---|")
    for s in (LLAMA_8B, LLAMA_70B):
        p = predict(s)
        rest = p["masters"] + p["gradients"] + p["optimizer_state"]
        print(
            f"| {s.name} | {p['params'] / 1e9:.1f} B | {p['weights'] / GiB:.1f} GiB | "
            f"{rest / GiB:.2f} GiB | {p['total'] / GiB:.1f} GiB |"
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


def child_save(path: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_config(SMALL)).to(torch.bfloat16).save_pretrained(path)
    return {}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child_measure(path: str, steps: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from roundpipe_core import RoundPipeRunConfig, wrap_model_to_roundpipe
    from roundpipe_core.presets import causal_lm_loss_fn
    from roundpipe_core.running.host_memory import estimate_host_memory

    base_rss = _status("VmRSS")
    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=16, target_modules=targets, lora_dropout=0.0))
    model.train()
    # loading's transient (the bf16 checkpoint read and quantized) is not the run's: give
    # freed heap back to the system, then count the peak from here on
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    loaded_rss = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rp = wrap_model_to_roundpipe(
        model,
        optim_dtype=torch.float32,
        devices=2,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-4)
    ids = torch.randint(0, SMALL.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        rp.forward_backward(
            input_kwargs={"input_ids": ids}, label=ids, loss_fn=causal_lm_loss_fn(ids)
        )
        rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.synchronize()
    budget = estimate_host_memory(rp, optimizer=opt)
    peak = _status("VmHWM") - base_rss
    rp.close()
    return {
        "budget": {
            k: getattr(budget, k)
            for k in (
                "num_params",
                "weights",
                "masters",
                "gradients",
                "optimizer_state",
                "worker_copies",
                "total",
            )
        },
        "peak_minus_start": peak,
        "loaded_minus_start": loaded_rss - base_rss,
    }


def _child(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(steps: int) -> None:
    with tempfile.TemporaryDirectory() as path:
        _child("save", path)
        res = _child("measure", path, str(steps))
    b = res["budget"]
    p = predict(SMALL)
    print(
        f"{SMALL.name}: {b['num_params'] / 1e9:.3f} B parameters, NF4 + LoRA r=16, AdamW, 2 CPU workers"
    )
    for key in ("weights", "masters", "gradients", "optimizer_state"):
        print(
            f"  {key:16s} budget {b[key] / 2**20:9.1f} MiB   table formula {p[key] / 2**20:9.1f} MiB"
        )
    print(f"  worker copies    budget {b['worker_copies'] / 2**20:9.1f} MiB (CPU workers only)")
    print(f"  budget total     {b['total'] / 2**20:9.1f} MiB")
    print(
        f"  measured peak    {res['peak_minus_start'] / 2**20:9.1f} MiB (whole process, above its RSS before loading)"
    )
    print(
        f"  of which after loading, before training: {res['loaded_minus_start'] / 2**20:9.1f} MiB"
    )
    print(f"  measured / budget = {res['peak_minus_start'] / b['total']:.2f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind = sys.argv[2]
        out = (
            child_save(sys.argv[3])
            if kind == "save"
            else child_measure(sys.argv[3], int(sys.argv[4]))
        )
        print(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["table", "measure", "all"], default="all")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.part in ("table", "all"):
        table()
    if args.part in ("measure", "all"):
        measure(args.steps)


if __name__ == "__main__":
    main()
