"""QLoRA: a bitsandbytes 4-bit / 8-bit base with peft LoRA trains through RoundPipe as
plain peft + bitsandbytes does (every adapter gets its gradient, within fp32 rounding),
the packed base stays bit-identical on the host, and bitsandbytes' own per-layer state
trips no forward rule. The replicas carry the packed weight and its quant state
(``running/carried.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from qlora_tiny import (  # noqa: E402
    QUANTS,
    base_state,
    load_qlora,
    make_batch,
    reference_grads,
    save_tiny_llama,
)

from roundpipe_core import (  # noqa: E402
    ModelExecutePlan,
    RoundPipe,
    RoundPipeRunConfig,
    wrap_model_to_roundpipe,
)
from roundpipe_core.presets import causal_lm_loss_fn  # noqa: E402

# embed | decoder 0 | decoder 1 | head: every decoder layer in its own backward stage
PLAN = ModelExecutePlan(
    fwd_plan=[range(0, 2), range(2, 3)],
    bwd_plan=[range(3, 4), range(2, 3), range(1, 2), range(0, 1)],
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _rule_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "forward rule" in str(w.message)]


def _train_once(pm, ids, mask, labels, inspect=None, **kwargs):
    """One forward_backward of ``pm`` through RoundPipe on 2 CPU workers, 2 microbatches:
    (loss, master grads by name, forward-rule warnings); ``inspect(rp)`` is called first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rp = wrap_model_to_roundpipe(
            pm,
            devices=2,
            model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN),
            **kwargs,
        )
        try:
            if inspect is not None:
                inspect(rp)
            loss = rp.forward_backward(
                input_kwargs={"input_ids": ids, "attention_mask": mask},
                label=labels,
                loss_fn=causal_lm_loss_fn(labels),
            )
            rp.synchronize()
            grads = {}
            for n, p in pm.named_parameters():
                if p.requires_grad:
                    master = rp.master_param(p)
                    grads[n] = None if master is None or master.grad is None else master.grad
        finally:
            rp.close()
    return loss, grads, _rule_warnings(caught)


def _check_grads(grads: dict, ref: dict) -> None:
    assert set(grads) == set(ref) and ref
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, f"adapters without a gradient: {missing}"
    for n, g in grads.items():
        err = ((g - ref[n]).norm() / ref[n].norm()).item()
        assert err <= 1e-5, f"{n}: relative error {err:.2e}"


@pytest.mark.parametrize("quant", QUANTS)
def test_qlora_gradients_match_plain_peft(saved, quant: str) -> None:
    ids, mask, labels = make_batch()
    ref_loss, ref = reference_grads(saved, quant, ids, mask, labels)
    pm = load_qlora(saved, quant)
    before = base_state(pm)
    loss, grads, rules = _train_once(pm, ids, mask, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    _check_grads(grads, ref)
    assert not rules, rules
    after = base_state(pm)
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), f"host {k} changed"


def test_qlora_on_a_family_converted_by_its_structure(tmp_path) -> None:
    """A 4-bit base with LoRA on a Llama-like family that has no preset (OLMo 2: the
    converter by structure probes the quantized model and builds GenericDecoderBlocks):
    loss and every adapter gradient are plain peft + bitsandbytes' on the same model."""
    from roundpipe_core.presets import GenericDecoderBlock

    path = save_tiny_llama(tmp_path, family="Olmo2")
    ids, mask, labels = make_batch()
    ref_loss, ref = reference_grads(path, "nf4", ids, mask, labels)
    pm = load_qlora(path, "nf4")
    before = base_state(pm)

    def converted_by_structure(rp) -> None:
        assert isinstance(rp, RoundPipe)
        assert all(isinstance(rp.layers[i], GenericDecoderBlock) for i in (1, 2))

    loss, grads, rules = _train_once(pm, ids, mask, labels, inspect=converted_by_structure)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    _check_grads(grads, ref)
    assert not rules, rules
    for k, v in base_state(pm).items():
        assert torch.equal(v, before[k]), f"host {k} changed"


@pytest.mark.parametrize("quant", ["nf4", "fp4-dq"])
def test_qlora_model_left_in_eval_mode_trains_every_adapter(saved, quant: str) -> None:
    """``from_pretrained`` returns an eval-mode model. On CPU, bitsandbytes then runs a
    forward whose input needs no grad (a training call's forward stages) with a repacked
    weight and a bf16 kernel, and rewrites the layer's quant state to say so: a replica
    that kept that state across uploads computed garbage from the next upload's weight
    (the first layer's attention adapters got no gradient) and a recompute that did not
    compute what the forward did (0.5 % off). Replicas take the exact path, so the eval-
    mode model trains as the train-mode one does (no dropout here)."""
    ids, mask, labels = make_batch()
    ref_loss, ref = reference_grads(saved, quant, ids, mask, labels)
    pm = load_qlora(saved, quant, train=False)
    before = base_state(pm)
    loss, grads, rules = _train_once(pm, ids, mask, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    _check_grads(grads, ref)
    assert not rules, rules
    for k, v in base_state(pm).items():
        assert torch.equal(v, before[k]), f"host {k} changed"


def test_prepare_model_for_kbit_training_style_model(saved) -> None:
    """peft's recipe: layer norms and the head in fp32, an input-grad hook on the
    embeddings; trains as plain peft does."""
    ids, mask, labels = make_batch()
    ref_loss, ref = reference_grads(saved, "nf4", ids, mask, labels, kbit_prep=True)
    pm = load_qlora(saved, "nf4", kbit_prep=True)
    loss, grads, rules = _train_once(pm, ids, mask, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    _check_grads(grads, ref)
    assert not rules, rules


def test_qlora_trains_several_steps_and_only_adapters_change(saved) -> None:
    pm = load_qlora(saved, "nf4")
    before = base_state(pm)
    adapters = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    rp = wrap_model_to_roundpipe(pm, devices=2, optim_dtype=torch.float32)
    try:
        opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
        ids, mask, labels = make_batch()
        losses = []
        for _ in range(4):
            losses.append(
                rp.forward_backward(
                    input_kwargs={"input_ids": ids, "attention_mask": mask},
                    label=labels,
                    loss_fn=causal_lm_loss_fn(labels),
                ).item()
            )
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        rp.synchronize()
    finally:
        rp.close()
    assert losses[-1] < losses[0]
    for k, v in base_state(pm).items():
        assert torch.equal(v, before[k]), f"host {k} changed"
    named = dict(pm.named_parameters())
    assert all(not torch.equal(named[n].detach(), a) for n, a in adapters.items())


# -- layers that keep tensors as plain attributes --------------------------------------
class ScaledByAttribute(nn.Module):
    """Keeps constant tensors as plain attributes (not buffers): one, and a tuple."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = torch.linspace(0.5, 1.5, dim)
        self.extra = (torch.full((dim,), 0.1), "shift")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.extra[0]


def test_plain_tensor_attributes_travel_with_the_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ScaledByAttribute(6), nn.Tanh(), ScaledByAttribute(6))
    ref = nn.Sequential(*[m for m in model])  # same modules: reference first
    x = torch.randn(4, 6)
    ref_loss = ref(x).pow(2).sum()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    model.zero_grad(set_to_none=True)
    rp = RoundPipe(model, devices="cpu:2")
    try:
        loss = rp.forward_backward((x,), loss_fn=lambda o, _: o.pow(2).sum())
        rp.synchronize()
        torch.testing.assert_close(loss, ref_loss.detach())
        for n, p in rp.optim_named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], msg=n)
    finally:
        rp.close()


class TrainsAPlainAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gain = torch.ones(3)  # a trainable one should have been an nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain


def test_a_trainable_plain_attribute_is_refused_naming_it() -> None:
    model = nn.Sequential(nn.Linear(3, 3), TrainsAPlainAttribute())
    model[1].gain.requires_grad_(True)
    with pytest.raises(
        ValueError,
        match=r"layer 1: module '\(root\)' \(TrainsAPlainAttribute\) attribute 'gain'.*nn\.Parameter",
    ):
        RoundPipe(model, devices="cpu:1")
    # added after wrapping: refused at the upload, and the next call still works
    layer = TrainsAPlainAttribute()
    rp = RoundPipe(nn.Sequential(nn.Linear(3, 3), layer), devices="cpu:1")
    try:
        rp(torch.randn(2, 3))
        layer.gain = torch.ones(3, requires_grad=True)
        with pytest.raises(ValueError, match=r"attribute 'gain'"):
            rp.forward_backward((torch.randn(2, 3),), loss_fn=lambda o, _: o.sum())
        layer.gain = torch.ones(3)
        loss = rp.forward_backward((torch.randn(2, 3),), loss_fn=lambda o, _: o.sum())
        assert torch.isfinite(loss)
    finally:
        rp.close()


# -- the host-memory budget and the planner count packed bytes -----------------------------
def _quant_state_tensors(model) -> list[torch.Tensor]:
    import bitsandbytes as bnb

    out = []
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            out += [qs.absmax, qs.code]
            if qs.state2 is not None:
                out += [qs.offset, qs.state2.absmax, qs.state2.code]
    return out


@pytest.mark.cpu_backend  # about what CPU workers copy: they stay CPU workers under fake CUDA
def test_cpu_workers_budget_only_the_quant_state_they_copy(saved) -> None:
    """CPU workers compute on the host's packed weights (lent) and copy only the quant
    state and buffers: the budget's worker line is those bytes, not the packed (nor the
    dequantized) weights; the LoRA gradients are the masters' (fp32 both)."""
    from roundpipe_core import ModelExecutePlan
    from roundpipe_core.running.host_memory import estimate_host_memory

    pm = load_qlora(saved, "nf4-dq")
    rp = wrap_model_to_roundpipe(pm, devices=2)
    try:
        one_stage = ModelExecutePlan()
        one_stage.fwd_plan, one_stage.bwd_plan = [], [range(0, rp.num_layers)]
        budget = estimate_host_memory(rp, optimizer="adamw", plan=one_stage, num_microbatch=2)
        copied = list(pm.buffers()) + _quant_state_tensors(pm)
        want = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in copied}
        assert budget.worker_copies == sum(want.values())
        assert 0 < budget.worker_copies < budget.weights / 4
    finally:
        rp.close()


@pytest.mark.parametrize("quant", ["nf4", "nf4-dq"])
def test_host_memory_budget_counts_packed_weights_and_quant_state(saved, quant: str) -> None:
    from roundpipe_core.running.host_memory import estimate_host_memory

    pm = load_qlora(saved, quant)
    import transformers as tf

    full = sum(p.numel() for p in tf.LlamaForCausalLM.from_pretrained(saved).parameters())
    tensors = list(pm.parameters()) + list(pm.buffers()) + _quant_state_tensors(pm)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    expected_weights = sum(storages.values())
    rp = wrap_model_to_roundpipe(pm, devices=2)
    try:
        budget = estimate_host_memory(rp, optimizer="adamw")
        assert budget.weights == expected_weights
        # counted in weights, as unpacked: 2 per byte of a packed 4-bit parameter
        assert budget.num_params == full + sum(
            p.numel() for n, p in pm.named_parameters() if "lora_" in n
        )
        # the planner's sizes: what an upload of each layer moves, quant state included
        for layer, nbytes in zip(rp.layers, rp.model_timer.layer_param_bytes):
            own = list(layer.parameters()) + list(layer.buffers()) + _quant_state_tensors(layer)
            want = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in own}
            assert nbytes == sum(want.values())
    finally:
        rp.close()


def test_budget_counts_one_dequantized_weight_per_cpu_worker(saved) -> None:
    """bitsandbytes dequantizes a 4-bit weight for each matmul on a CPU worker and frees
    it after: per worker, the largest one among the stages it runs (the tiny model's
    MLP weights, 64 x 128, in the quant state's dtype fp32 = the compute dtype)."""
    from roundpipe_core.running.host_memory import estimate_host_memory

    pm = load_qlora(saved, "nf4-dq")
    largest = 64 * 128 * 4
    rp = wrap_model_to_roundpipe(pm, devices=2)
    try:
        one_stage = ModelExecutePlan()
        one_stage.fwd_plan, one_stage.bwd_plan = [], [range(0, rp.num_layers)]
        budget = estimate_host_memory(rp, optimizer="adamw", plan=one_stage, num_microbatch=2)
        assert budget.dequantized == largest  # one worker runs the one stage
        # PLAN: worker 0 runs decoder 0 (forward stage 0), worker 1 decoder 1
        budget = estimate_host_memory(rp, optimizer="adamw", plan=PLAN, num_microbatch=2)
        assert budget.dequantized == 2 * largest
        assert ("dequantized weights", 2 * largest) in budget.rows()
        assert budget.total == sum(b for _, b in budget.rows())
    finally:
        rp.close()


def test_dequantized_weight_with_another_compute_dtype_holds_both() -> None:
    """``dequantize_4bit(...).to(compute dtype)``: a bf16 weight computed in fp32 holds
    its bf16 dequantization and the fp32 copy (2 + 4 bytes per weight)."""
    import bitsandbytes as bnb

    from roundpipe_core.running.host_memory import layer_dequantized_bytes

    lin = bnb.nn.Linear4bit(64, 128, compute_dtype=torch.float32, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(
        torch.randn(128, 64, dtype=torch.bfloat16), requires_grad=False, quant_type="nf4"
    )
    lin = lin.to("cpu")  # bitsandbytes quantizes on the move to a device
    layer = nn.Sequential(lin)
    assert lin.weight.quant_state.dtype == torch.bfloat16
    assert layer_dequantized_bytes(layer) == 64 * 128 * (2 + 4)
    lin.compute_dtype = torch.bfloat16
    assert layer_dequantized_bytes(layer) == 64 * 128 * 2
    assert layer_dequantized_bytes(nn.Linear(4, 4)) == 0


def test_converting_never_repacks_the_host_base(saved) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes' Linear4bit repacks its weight for good on
    an eval-mode forward without grad, and then computes through a kernel autograd does
    not know (adapters without gradients, the loss off by 2.5e-5). The converter's probe
    runs such forwards on the host model, so it must run them as replicas do (the flag
    off). The flag is forced on here so that any CPU shows it."""
    import bitsandbytes as bnb

    from roundpipe_core.presets import convert_to_sequential

    pm = load_qlora(saved, "nf4")
    layers = [m for m in pm.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers
    for m in layers:
        m.support_avx512bf16_for_cpu = True
    before = base_state(pm)
    convert_to_sequential(pm)
    assert all(m.support_avx512bf16_for_cpu for m in layers), "the flag is restored"
    repacked = [m for m in layers if getattr(m.weight.quant_state, "packing_format_for_cpu", 0)]
    assert not repacked, f"{len(repacked)} 4-bit weights repacked by the probe"
    for k, v in base_state(pm).items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), f"host {k} changed"
