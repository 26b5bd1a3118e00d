"""LoRA through peft: a peft-wrapped Llama converts; only the adapters train."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_tiny import make_batch, make_model  # noqa: E402

from roundpipe_core import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.presets import causal_lm_loss_fn  # noqa: E402


def _lora_llama():
    model = make_model("llama")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    # lora_B starts at zero; give it values so adapter gradients reach lora_A too
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return pm


def test_lora_gradients_match_peft() -> None:
    pm = _lora_llama()
    ids, mask, labels = make_batch(padding="left")
    out = pm(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ref = {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}
    pm.zero_grad(set_to_none=True)
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 2), range(2, 4)], bwd_plan=[range(4, 5), range(2, 4), range(0, 2)]
    )
    rp = wrap_model_to_roundpipe(
        pm, devices=2, model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    )
    try:
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        for n, p in pm.named_parameters():
            master = rp.master_param(p)
            if not p.requires_grad:
                assert master is None, f"frozen {n} got a master copy"
                continue
            err = ((master.grad - ref[n]).abs().max() / ref[n].abs().max()).item()
            assert err <= 1e-5, f"{n}: rel err {err:.2e}"
        # peft's own helpers stay reachable
        assert rp.peft_config["default"].r == 4
    finally:
        rp.close()


def test_lora_training_only_changes_adapters() -> None:
    pm = _lora_llama()
    base = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    assert base and adapters and all("lora_" in n for n in adapters)
    rp = wrap_model_to_roundpipe(pm, devices=2, optim_dtype=torch.float32)
    try:
        masters = rp.optim_parameters()
        assert len(masters) == len(adapters)
        opt = torch.optim.AdamW(masters, lr=1e-2)
        ids, mask, labels = make_batch(padding="right")
        for _ in range(3):
            rp.forward_backward(
                input_kwargs={"input_ids": ids, "attention_mask": mask},
                label=labels,
                loss_fn=causal_lm_loss_fn(labels),
            )
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        named = dict(pm.named_parameters())
        for n, before in base.items():
            assert torch.equal(named[n].detach(), before), f"frozen {n} changed"
            assert named[n].grad is None
        for n, before in adapters.items():
            assert not torch.equal(named[n].detach(), before), f"adapter {n} did not train"
        # optimizer state exists only for the adapters' master copies
        assert len(opt.state) == len(adapters)
        state_ids = {id(p) for p in opt.state}
        assert state_ids == {id(rp.master_param(named[n])) for n in adapters}
    finally:
        rp.close()
