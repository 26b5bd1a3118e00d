"""A sharded checkpoint of two optimizers: each optimizer's shards hold its own
parameters only, and each loads back from its own (the other optimizer's masters are
not "missing" from them). In one process, through the functions the strategies use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from roundpipe_core import distributed as D
from roundpipe_lightning.sharded_checkpoint import load_optimizer_state, marker, of_optimizer

pytestmark = pytest.mark.host_only


def test_each_optimizer_loads_from_its_own_shards(tmp_path: Path) -> None:
    torch.manual_seed(0)
    named = {f"p{i}": nn.Parameter(torch.randn(3)) for i in range(4)}
    first = torch.optim.AdamW([named["p0"], named["p1"]], lr=0.1)
    second = torch.optim.SGD([named["p2"], named["p3"]], lr=0.1, momentum=0.9)
    for p in named.values():
        p.grad = torch.randn(3)
    first.step()
    second.step()
    for i, opt in enumerate((first, second)):  # what save_host_shards writes per optimizer
        D.save_shard(tmp_path / f"o{i}", of_optimizer(named, opt), opt, lambda p: True, 0, 1)
    saved = {n: p.detach().clone() for n, p in named.items()}
    fresh = {n: nn.Parameter(torch.zeros(3)) for n in named}
    first2 = torch.optim.AdamW([fresh["p0"], fresh["p1"]], lr=0.1)
    second2 = torch.optim.SGD([fresh["p2"], fresh["p3"]], lr=0.1, momentum=0.9)
    for i, opt in enumerate((first2, second2)):
        load_optimizer_state(tmp_path / f"o{i}", opt, marker(1), None, fresh)
    for n, p in fresh.items():
        assert torch.equal(p, saved[n]), n
    assert torch.equal(
        first2.state[fresh["p1"]]["exp_avg_sq"], first.state[named["p1"]]["exp_avg_sq"]
    )
    assert torch.equal(
        second2.state[fresh["p3"]]["momentum_buffer"], second.state[named["p3"]]["momentum_buffer"]
    )
