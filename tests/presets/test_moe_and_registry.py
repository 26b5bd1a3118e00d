"""Qwen3-MoE routing replay in recompute; the preset registry and attribute fall-through."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from hf_tiny import make_batch, make_model  # noqa: E402

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.context import RecomputeStore, running_layer  # noqa: E402
from roundpipe_core.presets import (  # noqa: E402
    causal_lm_loss_fn,
    convert_to_sequential,
    known_presets,
    register_preset,
)
from roundpipe_core.presets.common import GenericDecoderBlock  # noqa: E402


def _capture_expert_choice(model) -> tuple[list, list]:
    """Record the top-k expert indices every MoE experts module receives."""
    seen: list[torch.Tensor] = []
    handles = []
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts"):
            handles.append(mod.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())))
    return seen, handles


def test_moe_recompute_replays_forward_routing() -> None:
    """Recompute uses the forward's experts even when the router would now choose others."""
    model = make_model("qwen3_moe")
    seq = convert_to_sequential(model)
    block = seq[1]
    assert isinstance(block, GenericDecoderBlock) and block.num_routers == 1
    ids, mask, _ = make_batch(padding="right")
    state = seq[0](input_ids=ids, attention_mask=mask)
    seen, handles = _capture_expert_choice(model)
    store = RecomputeStore()
    cpu = torch.device("cpu")
    with torch.no_grad(), running_layer(1, 0, False, store, cpu):
        out_fwd = block(state)[0]
    gate = model.model.layers[0].mlp.gate
    # A different router: plain re-execution would route differently.
    with torch.no_grad():
        gate.weight.copy_(torch.randn_like(gate.weight) * 3)
    with torch.no_grad():
        block(state)
    with torch.enable_grad(), running_layer(1, 0, True, store, cpu):
        out_re = block(state)[0]
        out_re.sum().backward()
    for h in handles:
        h.remove()
    fwd_choice, plain_choice, re_choice = seen
    assert not torch.equal(plain_choice, fwd_choice), (
        "test setup: the new router must route differently"
    )
    assert torch.equal(re_choice, fwd_choice), "recompute did not replay the forward's routing"
    assert gate.weight.grad is not None and gate.weight.grad.abs().max() > 0, (
        "router got no gradient"
    )
    assert out_re.shape == out_fwd.shape


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_moe_with_recompute_matches_hf(grain: str) -> None:
    """Qwen3-MoE: the decoder blocks are recomputed in backward stages; grads equal HF's."""
    model = make_model("qwen3_moe")
    ids, mask, labels = make_batch(padding="left")
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    # layers 1..3 (the MoE / dense decoder blocks) sit in non-fused backward stages: recomputed
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 2), range(2, 4)], bwd_plan=[range(4, 5), range(1, 4), range(0, 1)]
    )
    rp = wrap_model_to_roundpipe(
        model,
        devices=3,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=3, execute_plan=plan, recompute_grain=grain
        ),
    )
    try:
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        for n, p in model.named_parameters():
            g = rp.master_param(p).grad
            if n not in ref:
                assert g is None or g.abs().max() == 0, n
                continue
            err = ((g - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item()
            assert err <= 1e-5, f"{n}: rel err {err:.2e}"
    finally:
        rp.close()


def test_shared_parameters_and_fallthrough() -> None:
    model = make_model("gpt2")
    rp = wrap_model_to_roundpipe(model, devices=1)
    try:
        # attribute access falls through to the HF model
        assert rp.config is model.config
        assert rp.config.vocab_size == 97
        assert rp.get_output_embeddings() is model.lm_head
        assert rp.get_input_embeddings() is model.transformer.wte
        # the Sequential reuses the HF modules; tied weights are one Parameter
        assert rp.model[1].layer is model.transformer.h[0]
        assert rp.model[0].embed_tokens.weight is rp.model[-1].lm_head.weight
        n_unique = len({id(p) for p in model.parameters()})
        assert len(rp.optim_parameters()) == n_unique
        # the HF state_dict is what RoundPipe trains
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
        ids, mask, labels = make_batch(padding="right")
        rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )
        before = model.state_dict()["transformer.wte.weight"].clone()
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        after = model.state_dict()["transformer.wte.weight"]
        assert not torch.equal(before, after)
        assert torch.equal(after, rp.master_param(model.transformer.wte.weight).detach())
    finally:
        rp.close()


def test_unknown_class_lists_presets() -> None:
    class NotAnLM(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ValueError) as info:
        wrap_model_to_roundpipe(NotAnLM(), use_sequential_preset=True, devices=1)
    msg = str(info.value)
    assert "NotAnLM" in msg
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel", "Qwen3MoeForCausalLM"):
        assert name in msg and name in known_presets()


def test_register_preset_by_class_and_name() -> None:
    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(11, 4)
            self.head = nn.Linear(4, 11)
            self.special = 42

        def forward(self, ids):
            return self.head(self.emb(ids))

    class TinyLMChild(TinyLM):
        pass

    register_preset(TinyLM, lambda m: nn.Sequential(m.emb, m.head))
    try:
        rp = wrap_model_to_roundpipe(TinyLMChild(), devices=1)  # subclasses match
        try:
            assert isinstance(rp, RoundPipe) and rp.num_layers == 2 and rp.special == 42
            ids = torch.randint(0, 11, (3, 5))
            with torch.no_grad():
                assert torch.allclose(rp(ids), rp._original_model(ids))
        finally:
            rp.close()
    finally:
        from roundpipe_core.presets import _REGISTRY

        _REGISTRY.pop(TinyLM, None)

    class ByName(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    register_preset("ByName", lambda m: nn.Sequential(m.lin))
    try:
        assert "ByName" in known_presets()
        assert isinstance(convert_to_sequential(ByName()), nn.Sequential)
    finally:
        from roundpipe_core.presets import _REGISTRY

        _REGISTRY.pop("ByName", None)
    with pytest.raises(TypeError):
        register_preset(3, lambda m: m)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        register_preset("X", "not callable")  # type: ignore[arg-type]


def test_bad_inputs_raise_clear_errors() -> None:
    model = make_model("llama")
    seq = convert_to_sequential(model)
    ids, mask, _ = make_batch()
    with pytest.raises(TypeError, match="cache"):
        seq[0](input_ids=ids, past_key_values=object())
    with pytest.raises(ValueError, match="2D"):
        seq[0](input_ids=ids, attention_mask=mask[:, None, None, :])
    with pytest.raises(ValueError, match="exactly one"):
        seq[0]()
