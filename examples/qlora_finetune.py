"""QLoRA with RoundPipe: LoRA adapters over a 4-bit (bitsandbytes NF4) Llama base.

    python examples/qlora_finetune.py [--devices cpu:2] [--steps 40] [--quant nf4|fp4|int8]

A tiny Llama-shaped model is built from a config (nothing is downloaded), saved, and
reloaded quantized with ``BitsAndBytesConfig`` -- the way a real checkpoint is loaded
in 4-bit. peft's ``prepare_model_for_kbit_training`` and ``LoraConfig`` add the
adapters; ``wrap_model_to_roundpipe`` pipelines the model. The packed 4-bit base
stays in host memory and is uploaded packed, with its quant state, to each device
that runs a stage; only the adapters have master copies, gradients and optimizer
state. Trains on ``examples/data/tiny_corpus.txt`` (byte-level vocabulary).
Needs ``pip install "roundpipe-lightning[qlora]"`` (bitsandbytes runs on CPU too).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from roundpipe_core import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe_core.presets import count_label_tokens, model_output_loss
from roundpipe_core.running.host_memory import estimate_host_memory

CORPUS = pathlib.Path(__file__).parent / "data" / "tiny_corpus.txt"
PAD = 256  # byte ids 0..255, plus a padding id


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """Random windows of the corpus: input_ids, attention_mask, labels."""
    while True:
        starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
        ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
        yield ids, torch.ones_like(ids), ids


def quantized_llama(directory: str, quant: str, layers: int, hidden: int) -> Any:
    """A random tiny Llama, saved and reloaded quantized by bitsandbytes."""
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=PAD + 1,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    if quant == "int8":
        qconfig = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qconfig = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    return LlamaForCausalLM.from_pretrained(directory, quantization_config=qconfig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--devices", default=None, help="None (all GPUs, else 2 CPU workers), an int, or 'cpu:N'"
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--hidden", type=int, default=128, help="a multiple of 64 (bitsandbytes' block)"
    )
    ap.add_argument("--quant", default="nf4", choices=["nf4", "fp4", "int8"])
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args(argv)

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' loading chatter
        model = quantized_llama(directory, args.quant, args.layers, args.hidden)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    model = get_peft_model(
        model,
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
        ),
    )
    model.train()
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}

    rp = wrap_model_to_roundpipe(
        model,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches),
        devices=args.devices,
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=args.lr)
    budget = estimate_host_memory(rp, optimizer=opt)
    print(
        f"{rp!r}: {args.quant} base, {len(rp.optim_parameters())} adapter tensors; host budget "
        f"{budget.total / 2**20:.1f} MiB for {budget.num_params:,} parameters "
        f"({budget.bytes_per_param:.2f} B/param)"
    )

    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    stream = batches(data, args.batch, args.seq, torch.Generator().manual_seed(0))
    losses: list[float] = []
    for step in range(1, args.steps + 1):
        ids, mask, labels = next(stream)
        loss = rp.forward_backward(
            input_kwargs={
                "input_ids": ids,
                "attention_mask": mask,
                "labels": labels,
                "num_items_in_batch": count_label_tokens(labels),
            },
            loss_fn=model_output_loss,
        )
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        losses.append(loss.item())
        if step == 1 or step % 10 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.3f}")
    rp.synchronize()  # the adapters of the peft model now hold the trained values
    unchanged = all(torch.equal(v, base[k]) for k, v in model.state_dict().items() if k in base)
    rp.close()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; 4-bit base unchanged: {unchanged}")
    return {"losses": losses, "base_unchanged": unchanged, "budget": budget}


if __name__ == "__main__":
    main()
