"""The automatic split (use_sequential_preset=False) on tiny Hugging Face models is never
silently wrong: loss and every gradient equal Hugging Face's own backward, or the split
refuses with a message naming the module and why.

Every case: 5 rows (an uneven split into 2 microbatches), left padding on one row with its
labels -100 there, fp32, compared with ``model(input_ids=, attention_mask=, labels=)``."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hf_tiny import rel_err

from roundpipe_core import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe_core.autosplit import AutoRoundPipe

transformers = pytest.importorskip("transformers")

RTOL = 1e-5
VOCAB = 128


def _batch(rows: int = 5, seq: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[1, :4] = 0  # left padding on one row
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _gemma() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        use_cache=False,
    )
    assert cfg.tie_word_embeddings  # the input embedding is the LM head
    return transformers.GemmaForCausalLM(cfg).train()


def _compare_with_hf(model: torch.nn.Module, rp_kwargs: dict, **call: torch.Tensor):
    """Loss and every gradient of the automatic split against HF's own backward."""
    ref = copy.deepcopy(model)
    ref_loss = ref(**call).loss
    ref_loss.backward()
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        devices="cpu:2",
        **rp_kwargs,
    )
    try:
        loss = rp(**call).loss
        assert rel_err(loss.detach(), ref_loss.detach()) <= RTOL, (loss.item(), ref_loss.item())
        loss.backward()
        rp.synchronize()
        masters = dict(rp.optim_named_parameters())
        for name, p in ref.named_parameters():
            got = masters[name].grad
            assert got is not None, f"no gradient for {name}"
            assert rel_err(got, p.grad) <= RTOL, name
    except BaseException:
        rp.close()
        raise
    return rp


@pytest.mark.parametrize("shared_masters", [None, False])
def test_tied_embeddings_are_shared_between_units_not_merged(shared_masters: bool | None) -> None:
    model = _gemma()
    rp = _compare_with_hf(model, {"shared_masters": shared_masters}, **_batch())
    try:
        assert isinstance(rp, AutoRoundPipe)
        names = [n for n, _ in rp.units]
        # the tied matrix sits in two units; the model is pipelined, not one unit
        assert "model.embed_tokens" in names and "lm_head" in names, names
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert rp.summary() == (
            f"{len(names)} units run on the device pool (0 of them pipelined over several "
            "layers), 0 parameters on the host, 1 of its parameters in several units (tied)"
        )
    finally:
        rp.close()


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(cfg).train()


@pytest.mark.parametrize("make", [_gemma, _gpt2], ids=["gemma", "gpt2_no_loss_type"])
def test_a_unit_computing_hf_loss_per_microbatch_is_combined_by_token_count(make) -> None:
    # a threshold the whole model is under: the root is one unit, its call cut in two, and
    # each microbatch computes Hugging Face's token-mean loss itself (GPT-2 has no
    # loss_type: Hugging Face falls back to the causal LM loss, and so does the split)
    model = make()
    rp = _compare_with_hf(model, {"split_threshold": 10**9}, **_batch())
    try:
        assert isinstance(rp, AutoRoundPipe) and [n for n, _ in rp.units] == [""]
        # the caller's own count (e.g. over several accumulated batches) is kept
        with torch.no_grad():
            got = rp(**_batch(), num_items_in_batch=7).loss
            want = model(**_batch(), num_items_in_batch=7).loss
        assert rel_err(got, want) <= RTOL
    finally:
        rp.close()


def test_a_scalar_a_unit_reduces_over_its_microbatches_is_refused() -> None:
    class MeanOut(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.aux = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.proj(x) + x, self.aux(x).mean()  # a mean over the whole call

    model = MeanOut()
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=False,
        split_threshold=10**9,
        lower_threshold=0,  # a unit this small would run as one microbatch otherwise
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        devices="cpu:2",
    )
    try:
        with pytest.raises(
            ValueError,
            match=r"unit '<root>' \(MeanOut\).*\{model: RoundPipeRunConfig\(num_microbatch=1",
        ):
            rp(torch.randn(5, 4))
    finally:
        rp.close()
    # the fix the message names: that module as one microbatch gives plain PyTorch's value
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=False,
        split_threshold=10**9,
        override_config={model: RoundPipeRunConfig(num_microbatch=1)},
        devices="cpu:2",
    )
    try:
        x = torch.randn(5, 4)
        assert rel_err(rp(x)[1].detach(), model(x)[1].detach()) <= RTOL
    finally:
        rp.close()


def test_a_unit_input_whose_dim0_is_not_the_batch_runs_unsplit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Bloom's blocks get ALiBi as (batch x heads, 1, seq): cutting it along dim 0 as if it
    # were the batch would hand each microbatch the wrong heads' rows
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, use_cache=False
    )
    with caplog.at_level(logging.INFO, logger="roundpipe_core.autosplit"):
        rp = _compare_with_hf(transformers.BloomForCausalLM(cfg).train(), {}, **_batch())
    try:
        assert any(n.startswith("transformer.h.0") for n, _ in rp.units)
        assert (
            "runs as one microbatch" in caplog.text
            and "kwargs['alibi'] of shape (20, 1, 12)" in caplog.text
        )
    finally:
        rp.close()


def test_a_module_whose_forward_uses_a_childs_weight_is_one_unit() -> None:
    # Mamba-2's mixer passes self.conv1d.weight (and in_proj's, out_proj's) to a fused
    # function in its own forward: opened, those weights would be used outside their units
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=16,
        state_size=8,
        n_groups=1,
        chunk_size=4,
        use_cache=False,
    )
    rp = _compare_with_hf(
        transformers.Mamba2ForCausalLM(cfg).train(),
        # a threshold under the mixer's size: by size alone it would be opened
        {"shared_masters": False, "split_threshold": 3000},
        **_batch(),
    )
    try:
        names = [n for n, _ in rp.units]
        assert "backbone.layers.0.mixer" in names, names
        assert rp.host_parameters == []
    finally:
        rp.close()


def _gemma3n() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Gemma3nTextConfig(
        vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB,
        hidden_size=32,
        hidden_size_per_layer_input=8,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_kv_shared_layers=1,  # layer 2 reuses the keys/values layer 0 stores
        laurel_rank=4,
        altup_num_inputs=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        activation_sparsity_pattern=[0.0] * 3,
        use_cache=False,
    )
    return transformers.Gemma3nForCausalLM(cfg).train()


def test_state_a_unit_writes_for_later_units_is_refused_and_the_named_fix_is_exact() -> None:
    model = _gemma3n()
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        devices="cpu:2",
    )
    try:
        with pytest.raises(
            ValueError,
            match=r"unit 'model.layers.0' \(Gemma3nTextDecoderLayer\) wrote into its input "
            r"kwargs\['shared_kv_states'\].*override_config=\{model.model: ",
        ):
            rp(**_batch())
    finally:
        rp.close()
    model = _gemma3n()
    rp = _compare_with_hf(
        model, {"override_config": {model.model: RoundPipeRunConfig()}}, **_batch()
    )
    rp.close()


def test_one_block_shared_by_several_layers_is_exact() -> None:
    # Zamba2's hybrid layers share one attention block's parameters ("could not separate
    # shared parameters" before): they stay in each unit holding them
    torch.manual_seed(0)
    cfg = transformers.Zamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_head_dim=8,
        mamba_d_state=8,
        mamba_headdim=8,
        n_mamba_heads=8,
        mamba_ngroups=1,
        chunk_size=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        hybrid_layer_ids=[1, 3],
        num_mem_blocks=1,
        use_mem_rope=False,
        intermediate_size=64,
        adapter_rank=4,
        use_shared_attention_adapter=False,
        use_cache=False,
    )
    rp = _compare_with_hf(
        transformers.Zamba2ForCausalLM(cfg).train(), {"shared_masters": False}, **_batch()
    )
    try:
        assert "model.layers.1.shared_transformer" in [n for n, _ in rp.units]
        assert "parameters in several units" in rp.summary()
    finally:
        rp.close()


def test_state_a_units_forward_keeps_on_its_module_is_refused_naming_it() -> None:
    torch.manual_seed(0)
    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=32,
        attention_window_size=8,
        conv1d_width=4,
        block_types=["recurrent", "recurrent", "attention"],
        head_dim=8,
        use_cache=False,
    )
    model = transformers.RecurrentGemmaForCausalLM(cfg).train()
    rp = wrap_model_to_roundpipe(
        copy.deepcopy(model),
        use_sequential_preset=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        devices="cpu:2",
    )
    try:
        with pytest.raises(
            ValueError,
            match=r"unit 'model.layers.0' \(RecurrentGemmaDecoderLayer\) stores state.*"
            r"module 'model.layers.0.temporal_block.rg_lru' \(RecurrentGemmaRglru\) attribute "
            r"'recurrent_states'.*skip_modules=\[model.get_submodule\('model.layers.0'\)\]",
        ):
            rp(**_batch())
    finally:
        rp.close()
    # the fix it names, for each recurrent layer: those run on the host, exactly
    skip = [layer for layer in model.model.layers if hasattr(layer.temporal_block, "rg_lru")]
    assert len(skip) == 2
    _compare_with_hf(model, {"skip_modules": skip}, **_batch()).close()


def _xlm() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.XLMConfig(
        vocab_size=VOCAB,
        emb_dim=32,
        n_layers=2,
        n_heads=4,
        dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.XLMWithLMHeadModel(cfg).train()


def test_a_unit_given_a_transformers_cache_is_refused_and_the_named_fix_is_exact() -> None:
    # XLM builds an EncoderDecoderCache even in training and hands it to every attention
    model = _xlm()
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        devices="cpu:2",
    )
    try:
        with pytest.raises(
            ValueError,
            match=r"unit 'transformer.attentions.0' \(MultiHeadAttention\) takes a transformers "
            r"EncoderDecoderCache as its input kwargs\['cache'\].*"
            r"override_config=\{model.transformer: RoundPipeRunConfig\(\)\}",
        ):
            rp(**_batch())
    finally:
        rp.close()
    model = _xlm()
    override = {  # its prediction layer's mean loss is refused too, with this fix
        model.transformer: RoundPipeRunConfig(),
        model.pred_layer: RoundPipeRunConfig(num_microbatch=1),
    }
    rp = _compare_with_hf(model, {"override_config": override}, **_batch())
    rp.close()
