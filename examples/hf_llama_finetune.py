"""Fine-tune a Hugging Face Llama with the RoundPipe core and the Llama preset (no Lightning).

    python examples/hf_llama_finetune.py [--devices cpu:2] [--steps 60] [--lora]

A tiny Llama-shaped model is built from a config (nothing is downloaded) and
trained on ``examples/data/tiny_corpus.txt`` with a byte-level vocabulary.
``wrap_model_to_roundpipe`` converts it into a pipelined Sequential; training
updates the Hugging Face model in place, so ``model.state_dict()`` /
``save_pretrained`` see the trained weights. With ``--lora`` the model is
wrapped by ``peft`` first and only the adapters train.
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from roundpipe_core import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe_core.presets import count_label_tokens, model_output_loss

CORPUS = pathlib.Path(__file__).parent / "data" / "tiny_corpus.txt"
PAD = 256  # byte ids 0..255, plus a padding id


def batches(data: torch.Tensor, batch: int, max_len: int, gen: torch.Generator):
    """Random windows of random length, right-padded: input_ids, attention_mask, labels."""
    while True:
        lengths = torch.randint(max_len // 2, max_len + 1, (batch,), generator=gen)
        starts = torch.randint(0, len(data) - max_len, (batch,), generator=gen)
        ids = torch.full((batch, max_len), PAD)
        mask = torch.zeros(batch, max_len, dtype=torch.long)
        for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
            ids[i, :n] = data[s : s + n]
            mask[i, :n] = 1
        yield ids, mask, ids.masked_fill(mask == 0, -100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--devices", default=None, help="None (all GPUs, else 2 CPU workers), an int, or 'cpu:N'"
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) only")
    args = ap.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=PAD + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,  # no KV cache in training
    )
    model = LlamaForCausalLM(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        )

    rp = wrap_model_to_roundpipe(
        model,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches),
        devices=args.devices,
    )
    print(
        f"{rp!r}: {rp.num_layers} layers (input adapter, {config.num_hidden_layers} decoder layers, "
        f"norm + lm_head); vocab {rp.config.vocab_size}; trainable tensors {len(rp.optim_parameters())}"
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=3e-3 if not args.lora else 1e-2)

    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    stream = batches(data, args.batch, args.seq, torch.Generator().manual_seed(0))
    first = last = None
    for step in range(1, args.steps + 1):
        ids, mask, labels = next(stream)
        # The model computes its own loss from labels=. num_items_in_batch counts the whole
        # batch's label tokens, so the per-microbatch losses sum to HF's mean loss of the batch;
        # return_logits=False computes it in token chunks without the (tokens x vocab) logits.
        loss = rp.forward_backward(
            input_kwargs={
                "input_ids": ids,
                "attention_mask": mask,
                "labels": labels,
                "num_items_in_batch": count_label_tokens(labels),
                "return_logits": False,
            },
            loss_fn=model_output_loss,
        )
        rp.step(lambda: (opt.step(), opt.zero_grad()))  # asynchronous: weights one step stale
        first = first if first is not None else loss.item()
        last = loss.item()
        if step == 1 or step % 10 == 0:
            print(f"step {step:3d}  loss {last:.3f}")
    rp.synchronize()  # the HF model now holds the trained weights

    # Pipelined inference on the converted model: greedy continuation of a prompt.
    prompt = torch.tensor([list(b"The lighthouse ")])
    with torch.no_grad():
        for _ in range(40):
            logits = rp(input_ids=prompt[:, -args.seq :]).logits
            prompt = torch.cat([prompt, logits[:, -1:].argmax(-1)], dim=1)
    text = bytes(min(t, 255) for t in prompt[0].tolist()).decode("utf-8", "replace")
    print(f"sample: {text!r}")
    rp.close()
    print(f"loss {first:.3f} -> {last:.3f}")


if __name__ == "__main__":
    main()
