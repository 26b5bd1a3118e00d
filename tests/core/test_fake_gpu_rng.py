"""Dropout replay across fake GPUs (tests/fake_gpu_rng.py): each fake GPU has its own
generator and its draws depend on its SM count, as a CUDA kernel's do."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, doing_recompute


class MaskLog(nn.Module):
    """Multiplies by a random 0/1 mask drawn on the device; logs (recompute?, mask)."""

    def __init__(self, cpu_draw: bool = False, log: list | None = None) -> None:
        super().__init__()
        self.cpu_draw = cpu_draw
        self.log: list[tuple[bool, torch.Tensor]] = [] if log is None else log

    def __deepcopy__(self, memo: dict) -> MaskLog:
        return MaskLog(self.cpu_draw, self.log)  # replicas log into the same list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_draw:  # the host's generator, whatever device the layer runs on
            noise = torch.rand(x.shape, generator=torch.default_generator)
        else:
            noise = torch.rand(x.shape, device=x.device)
        mask = (noise > 0.5).to(x.dtype)
        self.log.append((doing_recompute(), mask))
        return x * mask


def _model(cpu_draw: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), MaskLog(cpu_draw), nn.Linear(8, 2))


def _forward_on_0_recompute_on_1() -> ModelExecutePlan:
    # layers 0-1 forward on GPU 0; the fused stage (layer 2) on GPU 0; the backward of
    # layers 0-1 -- their recompute -- on GPU 1
    return ModelExecutePlan.from_layout(fwd="0:2", bwd="0:1,1:2", run_type="fused")


def _train(model: nn.Sequential, sm_counts: list[int], fake_gpu_rng: Any) -> list[str]:
    rng = fake_gpu_rng(sm_counts)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    rp = RoundPipe(model, devices=["cuda:0", "cuda:1"], pin_model="off")
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=_forward_on_0_recompute_on_1())
    try:
        rp.layer_activation_bytes = [0.0] * 3
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rp.forward_backward(
                (x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum(), run_config=cfg
            )
            rp.synchronize()
    finally:
        rp.close()
    assert model[1].cpu_draw or (rng.draws[0] and rng.draws[1]), rng.draws  # fwd GPU 0, re GPU 1
    return [str(w.message) for w in seen]


def _forward_and_recompute_masks(layer: MaskLog) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    fwd = [m for re, m in layer.log if not re]
    re = [m for re, m in layer.log if re]
    assert len(fwd) == len(re) == 2, [r for r, _ in layer.log]
    return fwd, re


def test_recompute_on_another_gpu_of_the_same_model_replays_the_masks(fake_gpu_rng: Any) -> None:
    model = _model()
    messages = _train(model, [82, 82], fake_gpu_rng)
    fwd, re = _forward_and_recompute_masks(model[1])
    for a, b in zip(fwd, re):
        assert torch.equal(a, b)
    assert not any("SM counts" in m or "CPU random" in m for m in messages), messages


def test_a_layer_drawing_on_the_cpu_is_named_on_gpu_workers(fake_gpu_rng: Any) -> None:
    """A CPU draw inside a layer is not replayed by a CUDA worker's recompute (only the
    GPU's generator is): the masks differ, and a warning names the layer, once."""
    model = _model(cpu_draw=True)
    messages = _train(model, [82, 82], fake_gpu_rng)
    fwd, re = _forward_and_recompute_masks(model[1])
    assert not all(torch.equal(a, b) for a, b in zip(fwd, re))
    named = [m for m in messages if "CPU random generator" in m]
    assert len(named) == 1 and "layer 1 (MaskLog)" in named[0], messages


def test_recompute_on_a_gpu_with_other_sm_counts_draws_other_masks_and_warns(
    fake_gpu_rng: Any,
) -> None:
    """The fake GPUs draw what a 3090 and a 4090 would: other masks in the recompute than
    in the forward, so the gradients are wrong; the pool says so once, before compute."""
    model = _model()
    messages = _train(model, [82, 128], fake_gpu_rng)
    fwd, re = _forward_and_recompute_masks(model[1])
    assert not all(torch.equal(a, b) for a, b in zip(fwd, re))
    assert sum("different SM counts" in m for m in messages) == 1, messages
