"""Random streams of a pipelined call: seeded once per segment between stage starts,
replayed exactly by every recompute, whatever the plan's stage boundaries."""

from __future__ import annotations

import pytest
import torch
from _util import sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.context import current_layer, current_microbatch, doing_recompute

pytestmark = pytest.mark.filterwarnings("ignore:RoundPipe forward rule violated")


class _MaskLog(nn.Module):
    """Dropout that records every mask it draws, keyed by (layer, microbatch)."""

    def __init__(self, p: float, log: dict) -> None:
        super().__init__()
        self.p, self.log = p, log

    def __deepcopy__(self, memo):  # replicas share the log
        new = _MaskLog(self.p, self.log)
        new.training = self.training
        return new

    def forward(self, x):
        mask = (torch.rand_like(x) >= self.p).to(x.dtype)
        if current_layer() is None:  # the first training call's activation measurement
            return x * mask
        kind = "recompute" if doing_recompute() else "forward"
        self.log.setdefault(kind, {}).setdefault(
            (current_layer(), current_microbatch()), []
        ).append(mask)
        return x * mask


def _model(log: dict, layers: int = 7) -> nn.Sequential:
    torch.manual_seed(5)
    blocks: list[nn.Module] = [nn.Linear(8, 10)]
    for _ in range(layers - 2):
        blocks.append(nn.Sequential(nn.Linear(10, 10), nn.Tanh(), _MaskLog(0.4, log)))
    blocks.append(nn.Linear(10, 3))
    return nn.Sequential(*blocks)


# Backward stages that cross forward stage starts (and the other way round): a stream that
# started only at backward stage starts would replay the wrong numbers in layer 2 and 4.
CROSSING = [
    ModelExecutePlan(
        [range(0, 2), range(2, 4), range(4, 5)], [range(5, 7), range(1, 5), range(0, 1)]
    ),
    ModelExecutePlan(
        [range(0, 3), range(3, 5)], [range(5, 7), range(4, 5), range(2, 4), range(0, 2)]
    ),
]


@pytest.mark.parametrize("plan", CROSSING, ids=["bwd-spans-fwd-starts", "fwd-spans-bwd-starts"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_replays_every_mask_when_stages_do_not_line_up(plan, grain):
    log: dict = {}
    rp = RoundPipe(_model(log), devices="cpu:2")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)
    try:
        cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan, recompute_grain=grain)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq, run_config=cfg)
    finally:
        rp.close()
    fwd, rec = log["forward"], log["recompute"]
    recomputed = {layer for r in plan.bwd_plan[1:] for layer in r if 1 <= layer <= 5}
    assert {k[0] for k in rec} == recomputed
    for key, masks in rec.items():
        for m in masks:
            assert torch.equal(m, fwd[key][0]), (
                f"recompute of (layer, microbatch) {key} drew new numbers"
            )
    # distinct layers and microbatches draw distinct numbers (streams are not shared)
    firsts = [v[0] for v in fwd.values()]
    assert len({tuple(m.flatten().tolist()) for m in firsts}) == len(firsts)


def test_seeded_calls_repeat_and_consecutive_calls_differ():
    def masks(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        log: dict = {}
        rp = RoundPipe(
            _model(log), devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        x, y = torch.randn(4, 8), torch.randn(4, 3)
        try:
            for _ in range(2):
                rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        finally:
            rp.close()
        return [m for _, v in sorted(log["forward"].items()) for m in v]

    a, b = masks(3), masks(3)
    assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
    # the two calls of one run draw different masks for the same (layer, microbatch)
    assert not torch.equal(a[0], a[1])


def test_forward_then_backward_replays_every_mask():
    """``rp(x)`` then ``loss.backward()``: the backward jobs run in a second phase of the
    same run and still find the forward stage starts the forward jobs recorded."""
    log: dict = {}
    rp = RoundPipe(_model(log), devices="cpu:2")
    plan = ModelExecutePlan(
        [range(0, 2), range(2, 4), range(4, 7)], [range(5, 7), range(1, 5), range(0, 1)]
    )
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)
    try:
        cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
        sum_sq(rp(x, roundpipe_run_config=cfg), y).backward()
    finally:
        rp.close()
    fwd, rec = log["forward"], log["recompute"]
    assert {k[0] for k in rec} == {1, 2, 3, 4, 5}
    for key, masks in rec.items():
        assert all(torch.equal(m, fwd[key][0]) for m in masks), key
