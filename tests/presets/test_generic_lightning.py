"""Families without a preset through the Lightning strategies: a LightningModule whose
``configure_sequential()`` returns Gemma 2 (soft-capped logits, tied embeddings, sliding
layers) and ``fabric.setup()`` of Cohere train as plain Lightning / Fabric does."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

from hf_tiny import gemma_kv_sharing_model  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from sweep_hf_families import build_tiny, make_batch  # noqa: E402

from roundpipe_core.presets import GenericDecoderBlock, causal_lm_loss_fn  # noqa: E402
from roundpipe_lightning import RoundPipeFabricStrategy, RoundPipeStrategy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = 2


def _data() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [make_batch() for _ in range(STEPS)]


def _assert_same_update(got: dict, want: dict, start: dict) -> None:
    assert got.keys() == want.keys() == start.keys()
    for n in got:
        assert not torch.equal(got[n], start[n]), f"{n} did not train"
        err = ((got[n] - want[n]).norm() / (want[n] - start[n]).norm()).item()
        assert err <= 1e-4, f"{n}: update off by {err:.2e} of its size"


class HFLit(L.LightningModule):
    def __init__(self, model: str | Callable[[], Any], roundpipe: bool) -> None:
        super().__init__()
        self.lm = build_tiny(model) if isinstance(model, str) else model()
        self.use_rp = roundpipe

    def configure_sequential(self):
        return self.lm

    def training_step(self, batch, batch_idx):
        ids, mask, labels = (t[0] for t in batch)  # one prepared batch per step
        if not self.use_rp:
            return self.lm(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.block_type = type(self.roundpipe.layers[1])
        return self.roundpipe.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _trainer(strategy: Any = "auto", devices: int = 1) -> Any:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


@pytest.mark.parametrize(
    "model",
    [
        "gemma2",
        partial(gemma_kv_sharing_model, "gemma3n"),
        partial(gemma_kv_sharing_model, "gemma4"),
    ],
    ids=["gemma2", "gemma3n", "gemma4-e2b"],
)
def test_trainer_trains_a_generic_family_like_plain_lightning(model: Any) -> None:
    """Gemma 3n and Gemma 4 E2B: per-layer inputs and KV sharing through the strategy too."""
    data = [tuple(t.unsqueeze(0) for t in b) for b in _data()]
    dl = torch.utils.data.DataLoader(data, batch_size=None)
    m, ref = HFLit(model, True), HFLit(model, False)
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    _trainer(RoundPipeStrategy(num_microbatch=2), devices=2).fit(m, dl)
    assert m.block_type is GenericDecoderBlock  # converted by structure, fused path
    _trainer().fit(ref, dl)
    got = {n: p.detach() for n, p in m.named_parameters()}
    want = {n: p.detach() for n, p in ref.named_parameters()}
    _assert_same_update(got, want, start)


def test_fabric_trains_a_generic_family_like_plain_fabric() -> None:
    data = _data()
    plain = build_tiny("cohere")
    start = {n: p.detach().clone() for n, p in plain.named_parameters()}
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.5))
    for ids, mask, labels in data:
        opt.zero_grad()
        fabric.backward(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
        opt.step()
    want = {n: p.detach() for n, p in plain.named_parameters()}

    net = build_tiny("cohere")
    fabric = Fabric(
        strategy=RoundPipeFabricStrategy(num_microbatch=3), accelerator="cpu", devices=2
    )
    try:
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
        assert isinstance(model.roundpipe.layers[1], GenericDecoderBlock)
        for ids, mask, labels in data:
            opt.zero_grad()
            model.forward_backward(
                input_kwargs={"input_ids": ids, "attention_mask": mask},
                label=labels,
                loss_fn=causal_lm_loss_fn(labels),
            )
            opt.step()
        model.synchronize()
        got = {n: p.detach() for n, p in net.named_parameters()}
        _assert_same_update(got, want, start)
    finally:
        fabric.strategy.teardown()
