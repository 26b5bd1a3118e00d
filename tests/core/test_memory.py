"""The CPU backend's ledger: a device holds only the stage it runs and the one it prefetches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


def _nbytes(module: nn.Module) -> int:
    return sum(
        t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers())
    )


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_param_memory_bound_and_everything_released(devices):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    plan = ModelExecutePlan(
        [range(0, 2), range(2, 4), range(4, 6)],
        [range(6, 8), range(4, 6), range(2, 4), range(0, 2)],
    )
    rp = RoundPipe(model, devices=f"cpu:{devices}")
    try:
        rp.forward_backward(
            (torch.randn(6, 32),),
            label=torch.randn(6, 32),
            loss_fn=lambda o, t: ((o - t) ** 2).sum(),
            run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan),
        )
        stage_bytes = 2 * _nbytes(model[0])
        for w in rp.pool.workers:
            assert w.ledger.peak.get("param", 0) <= 2 * stage_bytes  # running + prefetched
            assert w.ledger.current.get("param", 0) == 0
            assert w.ledger.current.get("activation", 0) == 0
        # with more than one job per device, prefetching shows up as two stages held
        if devices == 1:
            assert rp.pool.workers[0].ledger.peak["param"] == 2 * stage_bytes
    finally:
        rp.close()
