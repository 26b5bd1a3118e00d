"""The automatic split (use_sequential_preset=False) on tiny Hugging Face models is never
silently wrong: loss and every gradient equal Hugging Face's own backward, or the split
refuses with a message naming the module and why.

Every case: 5 rows (an uneven split into 2 microbatches), left padding on one row with its
labels -100 there, fp32, compared with ``model(input_ids=, attention_mask=, labels=)``."""

from __future__ import annotations

import copy

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
    finally:
        rp.close()
