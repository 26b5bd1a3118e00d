"""A converted Hugging Face model with tied embeddings trains with shared masters
(``wrap_model_to_roundpipe(..., shared_masters=True)``) exactly as Hugging Face
trains itself: the tied weight is one master, updated in place."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import hf_grads, make_batch, make_model, rel_err  # noqa: E402

from roundpipe_core import (  # noqa: E402
    ModelExecutePlan,
    OptimizerCtx,
    RoundPipeRunConfig,
    wrap_model_to_roundpipe,
)
from roundpipe_core.presets import causal_lm_loss_fn  # noqa: E402

RTOL = 1e-5


def test_tied_qwen3_trains_like_hugging_face_with_shared_masters() -> None:
    model = make_model("qwen3")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 2), range(2, 3)], bwd_plan=[range(3, 5), range(1, 3), range(0, 1)]
    )
    rp = wrap_model_to_roundpipe(
        model,
        devices=2,
        model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan),
        shared_masters=True,
    )
    try:
        tied = rp.layers[0].embed_tokens.weight
        assert tied is rp.layers[-1].lm_head.weight and rp.master_param(tied) is tied
        assert all(m is p for _, p, m in rp.masters.entries)
        with OptimizerCtx():
            opt = torch.optim.AdamW(rp.parameters(), lr=1e-2)
        for step in range(3):
            ids, mask, labels = make_batch(seed=10 + step)
            _, want = hf_grads(ref, input_ids=ids, attention_mask=mask, labels=labels)
            rp.forward_backward(
                input_kwargs={"input_ids": ids, "attention_mask": mask},
                label=labels,
                loss_fn=causal_lm_loss_fn(labels),
            )
            refs = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                assert rel_err(p.grad, want[name]) <= RTOL, f"step {step}: grad of {name}"
                # the same gradients into both optimizers: Adam divides tiny gradients by
                # their own size, which would magnify fp32 rounding into the weights
                refs[name].grad = p.grad.clone()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            rp.step(lambda: (opt.step(), opt.zero_grad(set_to_none=True)), is_async=False)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.detach(), q.detach()), f"step {step}: weight {name}"
    finally:
        rp.close()
