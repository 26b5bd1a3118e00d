"""Preset calls return a transformers ModelOutput; ``labels=`` with ``num_items_in_batch=``
and ``return_logits=False`` give Hugging Face's loss and gradients.

The merged ``.loss`` is computed from per-sample sums, so it is HF's loss of
the whole batch however the engine merges scalar outputs (summed or averaged).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import hf_grads, make_batch, make_model, rel_err  # noqa: E402

from roundpipe_core import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe_core.presets import count_label_tokens, model_output_loss  # noqa: E402

RTOL = 1e-5
PLAN = ModelExecutePlan(
    fwd_plan=[range(0, 3), range(3, 5)], bwd_plan=[range(4, 5), range(1, 4), range(0, 1)]
)


def assert_grads(rp, model, ref: dict, where: str) -> None:
    for name, p in model.named_parameters():
        got = rp.master_param(p).grad
        if name not in ref or ref[name].abs().max() == 0:
            assert got is None or got.abs().max() == 0, f"{where}: {name}"
            continue
        assert got is not None, f"{where}: no gradient for {name}"
        err = rel_err(got, ref[name])
        assert err <= RTOL, f"{where}: {name} rel err {err:.2e}"


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("return_logits", [True, False])
def test_labels_give_hf_loss_and_grads(kind: str, return_logits: bool) -> None:
    """rp(..., labels=y, return_logits=...) -> ModelOutput; .loss.backward() = HF's grads."""
    model = make_model(kind)
    ids, mask, labels = make_batch(padding="left", seed=3)
    ref, ref_grads = hf_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    rp = wrap_model_to_roundpipe(
        model, devices=2, model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=PLAN)
    )
    try:
        out = rp(input_ids=ids, attention_mask=mask, labels=labels, return_logits=return_logits)
        assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
        assert (out.logits is None) == (not return_logits)
        if return_logits:
            assert rel_err(out.logits, ref.logits.detach()) <= RTOL
        assert abs(out.loss.item() - ref.loss.item()) <= RTOL * ref.loss.item()
        assert out["loss"] is out.loss and out.to_tuple()[0] is out.loss
        out.loss.backward()
        assert_grads(rp, model, ref_grads, f"{kind}/return_logits={return_logits}")
    finally:
        rp.close()


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
@pytest.mark.parametrize("return_logits", [True, False])
def test_num_items_in_batch_with_forward_backward(return_logits: bool, loss_reduction: str) -> None:
    """Upstream's pattern: labels and num_items_in_batch (the whole batch's tokens) as inputs,
    loss_fn = the output's loss; the microbatch losses sum to HF's loss of the batch, under
    either loss_reduction (model_output_loss is batch-normalised: "mean" leaves it alone)."""
    model = make_model("qwen3")
    ids, mask, labels = make_batch(padding="right")
    n = count_label_tokens(labels)
    ref, ref_grads = hf_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    ref_n = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n * 2)
    rp = wrap_model_to_roundpipe(
        model, devices=3, model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    try:
        loss = rp.forward_backward(
            input_kwargs={
                "input_ids": ids,
                "attention_mask": mask,
                "labels": labels,
                "num_items_in_batch": n,
                "return_logits": return_logits,
            },
            loss_fn=model_output_loss,
            loss_reduction=loss_reduction,
        )
        assert abs(loss.item() - ref.loss.item()) <= RTOL * ref.loss.item()
        assert_grads(rp, model, ref_grads, f"forward_backward/return_logits={return_logits}")
        with torch.no_grad():  # HF's meaning of num_items_in_batch on a whole call, as a tensor too
            out = rp(
                input_ids=ids,
                attention_mask=mask,
                labels=labels,
                num_items_in_batch=torch.tensor(n * 2),
                return_logits=return_logits,
            )
        assert abs(out.loss.item() - ref_n.loss.item()) <= RTOL * ref_n.loss.item()
    finally:
        rp.close()


def test_merged_loss_is_exact_although_scalars_merge_by_averaging() -> None:
    """The engine averages 0-dim outputs over microbatches (the published RoundPipe's rule);
    .loss is rebuilt from per-sample sums, so it stays Hugging Face's whole-batch loss."""
    model = make_model("llama")
    ids, mask, labels = make_batch(padding="right")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    rp = wrap_model_to_roundpipe(
        model, devices=2, model_run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    try:
        with torch.no_grad():
            out = rp(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(out.loss.item() - ref.item()) <= RTOL * ref.item()
    finally:
        rp.close()


def test_call_argument_errors() -> None:
    model = make_model("llama")
    rp = wrap_model_to_roundpipe(model, devices=1)
    ids, mask, labels = make_batch()
    try:
        with pytest.raises(ValueError, match="needs labels"):
            rp(input_ids=ids, return_logits=False)
        with pytest.raises(TypeError, match="return_logits"):
            rp(input_ids=ids, labels=labels, return_logits="no")
        with pytest.raises(ValueError, match="num_items_in_batch"):
            rp(input_ids=ids, labels=labels, num_items_in_batch=0)
        with pytest.raises(ValueError, match="num_items_in_batch"):
            rp(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor([3, 4]))
        with pytest.raises(ValueError, match="logits_to_keep"):
            rp(input_ids=ids, labels=labels, logits_to_keep=1)
        with pytest.raises(TypeError, match="logits_to_keep"):
            rp(input_ids=ids, logits_to_keep=torch.tensor([1]))
        with pytest.raises(TypeError, match="output_router_logits"):
            rp(input_ids=ids, output_router_logits=True)  # a dense model has no router
        with pytest.raises(ValueError, match="outside the vocabulary"):
            rp(input_ids=ids, labels=labels.clamp(min=0) + 500, return_logits=False)
        with pytest.raises(TypeError, match=r"\.loss"):
            model_output_loss(rp(input_ids=ids))
    finally:
        rp.close()
