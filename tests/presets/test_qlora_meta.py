"""The host-memory budget of a model built on the meta device: a 4-bit model that
:func:`quantize_on_meta` lays out as bitsandbytes would, with peft LoRA, is budgeted
exactly as the same model saved and loaded quantized (what the Llama-3.1-8B / 70B table
in docs/host-memory.md relies on)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from qlora_tiny import HIDDEN, TARGETS, VOCAB, load_qlora, save_tiny_llama  # noqa: E402

from roundpipe_core.running.carried import carried_tensors  # noqa: E402
from roundpipe_core.running.host_memory import estimate_host_memory  # noqa: E402
from roundpipe_core.running.meta_quant import quantize_on_meta  # noqa: E402

pytestmark = [pytest.mark.host_only]

LINES = ("num_params", "weights", "masters", "gradients", "next_gradients", "optimizer_state")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _layout(layer: nn.Module) -> list[tuple[tuple[int, ...], torch.dtype]]:
    tensors = list(layer.parameters()) + list(layer.buffers()) + carried_tensors(layer)
    return sorted((tuple(t.shape), t.dtype) for t in tensors)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_meta_layout_is_what_bitsandbytes_quantization_holds(quant_type, double_quant) -> None:
    out_f, in_f = 96, 64 * 70  # 105 blocks of 64: the nested absmax has a partial block
    real = bnb.nn.Linear4bit(
        in_f, out_f, bias=False, quant_type=quant_type, compress_statistics=double_quant
    )
    real.weight = bnb.nn.Params4bit(
        torch.randn(out_f, in_f, dtype=torch.bfloat16),
        requires_grad=False,
        quant_type=quant_type,
        compress_statistics=double_quant,
    )
    real = real.to("cpu")  # bitsandbytes quantizes on the move to a device
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16))
    quantize_on_meta(meta, quant_type=quant_type, double_quant=double_quant)
    assert _layout(meta) == _layout(nn.Sequential(real))
    qs, mqs = real.weight.quant_state, meta[0].weight.quant_state
    assert (mqs.shape, mqs.dtype, mqs.blocksize, mqs.quant_type) == (
        qs.shape,
        qs.dtype,
        qs.blocksize,
        qs.quant_type,
    )


def _meta_tiny(path, quant: str | None):
    """The saved tiny Llama's config built on the meta device, ``quant`` laid out by
    :func:`quantize_on_meta`, with the LoRA adapters :func:`load_qlora` adds."""
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    if quant is not None:
        kind, _, dq = quant.partition("-")
        quantize_on_meta(
            model, quant_type=kind, double_quant=dq == "dq", compute_dtype=torch.float32
        )
    cfg_lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(model, cfg_lora)


def _budgets(a: nn.Module, b: nn.Module, **kwargs) -> tuple[dict, dict]:
    ba = estimate_host_memory(a, **kwargs)
    bb = estimate_host_memory(b, **kwargs)
    return {k: getattr(ba, k) for k in LINES}, {k: getattr(bb, k) for k in LINES}


@pytest.mark.parametrize("quant", ["nf4", "nf4-dq", "fp4-dq", None])
def test_budget_of_the_meta_model_equals_the_loaded_model(saved, quant) -> None:
    meta = _meta_tiny(saved, quant)
    assert all(p.is_meta for p in meta.parameters())
    if quant is None:
        import transformers as tf

        real = peft.get_peft_model(
            tf.LlamaForCausalLM.from_pretrained(saved),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0),
        )
    else:
        real = load_qlora(saved, quant)
    kwargs = {"optimizer": "adamw", "optim_dtype": torch.float32, "async_step": True}
    got, want = _budgets(meta, real, **kwargs)
    assert got == want
    assert want["weights"] > 0 and want["optimizer_state"] > 0
    # a 4-bit base: well under 1 byte per frozen weight; the adapters only train
    frozen = VOCAB * HIDDEN * 2  # embeddings and head, fp32
    if quant is not None:
        assert got["weights"] < frozen * 4 + got["num_params"]
    got, want = _budgets(meta, real, optimizer="sgd", shared_masters=True)
    assert got == want


def test_quantize_on_meta_refuses_a_real_model_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="not the meta device"):
        quantize_on_meta(nn.Sequential(nn.Linear(64, 64)))
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="quant_type"):
        quantize_on_meta(net, quant_type="int3")
    with pytest.raises(ValueError, match="blocksize"):
        quantize_on_meta(net, blocksize=0)
    # the head is kept as transformers keeps it
    with torch.device("meta"):
        lm = nn.Module()
        lm.body = nn.Linear(64, 64)
        lm.lm_head = nn.Linear(64, 10)
    quantize_on_meta(lm)
    assert isinstance(lm.body, bnb.nn.Linear4bit) and type(lm.lm_head) is nn.Linear
