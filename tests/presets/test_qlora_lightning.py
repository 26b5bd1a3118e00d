"""QLoRA through RoundPipeStrategy: a LightningModule whose configure_sequential()
returns a peft model over a bitsandbytes 4-bit base trains as plain Lightning does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from qlora_tiny import base_state, load_qlora, make_batch, save_tiny_llama  # noqa: E402

from roundpipe_core.presets import causal_lm_loss_fn  # noqa: E402
from roundpipe_lightning import RoundPipeStrategy  # noqa: E402


class QLoRALit(L.LightningModule):
    def __init__(self, path, quant: str, roundpipe: bool) -> None:
        super().__init__()
        self.lm = load_qlora(path, quant)
        self.use_rp = roundpipe

    def configure_sequential(self):
        return self.lm

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        if not self.use_rp:
            return self.lm(input_ids=ids, attention_mask=mask, labels=labels).loss
        return self.roundpipe.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


def _trainer(strategy: Any = "auto", devices: int = 1) -> Any:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


@pytest.mark.parametrize("quant", ["nf4"])
def test_qlora_lightning_module_trains_like_plain_lightning(tmp_path, quant: str) -> None:
    path = save_tiny_llama(tmp_path)
    data = torch.utils.data.TensorDataset(*make_batch(rows=8))
    dl = torch.utils.data.DataLoader(data, batch_size=4)
    m, ref = QLoRALit(path, quant, True), QLoRALit(path, quant, False)
    base = base_state(m.lm)
    start = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    _trainer(RoundPipeStrategy(num_microbatch=2), devices=2).fit(m, dl)
    _trainer().fit(ref, dl)
    got = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}
    want = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() == start.keys()
    for n in got:
        assert not torch.equal(got[n], start[n]), f"{n} did not train"
        err = ((got[n] - want[n]).norm() / (want[n] - start[n]).norm()).item()
        assert err <= 1e-4, f"{n}: update off by {err:.2e} of its size"
    for k, v in base_state(m.lm).items():
        assert torch.equal(v, base[k]), f"host {k} changed"
