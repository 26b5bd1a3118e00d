"""Tiny QLoRA models: a Llama (or a Llama-like family without a preset, OLMo 2) built
from a config, saved, reloaded quantized by
bitsandbytes (4-bit NF4/FP4 with or without double quantization, or 8-bit), with
peft LoRA adapters. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

# Taken at import, before any test's fake-CUDA fixture replaces it.
_REAL_CUDA_IS_AVAILABLE = torch.cuda.is_available


@contextlib.contextmanager
def host_loading() -> Iterator[None]:
    """Load (and quantize) on the host whatever the test device: under
    ROUNDPIPE_TEST_DEVICE=fake-cuda ``torch.cuda.is_available()`` says True, and
    transformers' bitsandbytes quantizer would then place the model on
    ``torch.cuda.current_device()`` of a torch built without CUDA. What the fake GPU
    should see is the engine's upload of the host model, which is what the tests check."""
    saved = torch.cuda.is_available
    torch.cuda.is_available = _REAL_CUDA_IS_AVAILABLE
    try:
        yield
    finally:
        torch.cuda.is_available = saved


VOCAB = 97
# bitsandbytes quantizes in blocks of 64 and its CPU kernels want rows in multiples of
# 32: a hidden size of 64 is the smallest that every kernel accepts
HIDDEN = 64
QUANTS = ["nf4", "fp4", "nf4-dq", "fp4-dq", "int8"]
TARGETS = ["q_proj", "v_proj", "down_proj"]


def save_tiny_llama(path: Path, layers: int = 2, family: str = "Llama") -> Path:
    """Save a tiny ``{family}ForCausalLM`` (``"Llama"``: a preset; ``"Olmo2"``: converted by
    its structure) at ``path``."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = getattr(tf, f"{family}Config")(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        use_cache=False,
    )
    getattr(tf, f"{family}ForCausalLM")(cfg).save_pretrained(path)
    return path


def quant_config(quant: str):
    import transformers as tf

    if quant == "int8":
        return tf.BitsAndBytesConfig(load_in_8bit=True)
    kind, _, dq = quant.partition("-")
    return tf.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_use_double_quant=dq == "dq",
        bnb_4bit_compute_dtype=torch.float32,
    )


def load_qlora(path: Path, quant: str, train: bool = True, kbit_prep: bool = False):
    """The saved model reloaded in ``quant``, with LoRA (r=4) on :data:`TARGETS`; the
    same adapters every time (seeded), ``lora_B`` nonzero so every adapter gets a
    gradient. ``train=False`` leaves it in eval mode, as ``from_pretrained`` returns it."""
    import peft
    import transformers as tf

    with warnings.catch_warnings(), host_loading():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quant_config(quant)
        )
        if kbit_prep:
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    pm.train(train)
    return pm


def make_batch(rows: int = 4, seq: int = 8, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def base_state(model) -> dict[str, torch.Tensor]:
    """Copies of every frozen tensor of ``model``, quant states included (bitsandbytes'
    state dict carries absmax, code, nested state, SCB)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def reference_grads(path: Path, quant: str, ids, mask, labels, kbit_prep: bool = False):
    """Plain peft + bitsandbytes in train mode on the whole batch: (loss, adapter grads)."""
    ref = load_qlora(path, quant, train=True, kbit_prep=kbit_prep)
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads
