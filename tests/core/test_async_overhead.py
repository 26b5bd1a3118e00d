"""The cheaper per-job bookkeeping still notices what changed on the host module
between calls: a cached skeleton follows replaced submodules, tensors and flags."""

from __future__ import annotations

import torch
from torch import nn

from roundpipe_core import RoundPipe, RoundPipeRunConfig


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
        nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Tanh(), nn.Dropout(0.5))),
        nn.Linear(6, 2),
    )


def test_cached_skeletons_follow_the_host_module_between_calls():
    model = _model()
    rp = RoundPipe(model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x = torch.randn(4, 6)
    try:
        model.eval()
        with torch.no_grad():
            for _ in range(2):  # every worker has cached skeletons of every layer now
                assert torch.allclose(rp(x), model(x))
            model[0][1] = nn.ReLU()  # a submodule replaced
            assert torch.allclose(rp(x), model(x))
            model[1][1][0] = nn.Sigmoid()  # ... deeper down
            assert torch.allclose(rp(x), model(x))
            model[1][0].bias = nn.Parameter(torch.ones(6))  # a tensor replaced
            assert torch.allclose(rp(x), model(x))
            model[1][1].add_module("extra", nn.Softsign())  # a submodule added
            assert torch.allclose(rp(x), model(x))
            model[1][1][1].p = 0.0  # a flag: dropout on, but drops nothing
            model.train()
            assert torch.allclose(rp(x), model(x))
    finally:
        rp.close()
