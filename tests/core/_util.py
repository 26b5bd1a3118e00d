"""Shared helpers of the core tests: small models and the plain-PyTorch reference."""

from __future__ import annotations

import copy

import torch
from torch import nn

from roundpipe_core import RoundPipe


def mlp(num_layers: int = 6, width: int = 12, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width)]
    for _ in range(num_layers - 2):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.Tanh()))
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def sum_sq(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def reference_grads(model: nn.Module, x, y, loss_fn=sum_sq):
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(x), y)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None
    }


def master_grads(rp: RoundPipe) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in rp.optim_named_parameters() if p.grad is not None}


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5, what: str = "") -> None:
    """|a - b| <= rel * max(|b|) + tiny: relative error at fp32 rounding level."""
    a, b = a.double(), b.double()
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1e-12)
    assert err <= rel * scale + 1e-12, (
        f"{what}: max abs err {err:.3e} vs scale {scale:.3e} (rel {err / scale:.3e})"
    )


def assert_grads_match(rp: RoundPipe, ref: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    got = master_grads(rp)
    assert set(got) == set(ref), f"grads for {sorted(set(got) ^ set(ref))} missing on one side"
    for n in ref:
        assert_close_rel(got[n], ref[n], rel, n)
