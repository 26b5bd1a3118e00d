"""chunked_linear_cross_entropy: per-token losses and gradients equal the plain
linear + fp32 cross-entropy, for every chunking, with ignored tokens, a bias and
non-uniform weights on the per-token losses."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import rel_err
from torch import nn

from roundpipe_core.presets import IGNORE_INDEX, chunked_linear_cross_entropy

pytestmark = pytest.mark.host_only


def _data(n: int = 23, h: int = 12, v: int = 31, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g).mul_(0.5).requires_grad_(True)
    b = torch.randn(v, generator=g).requires_grad_(True) if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[::4] = IGNORE_INDEX
    return hidden, weight, b, target


def _reference(hidden, weight, bias, target):
    logits = nn.functional.linear(hidden, weight, bias)
    return nn.functional.cross_entropy(
        logits.float(), target, ignore_index=IGNORE_INDEX, reduction="none"
    )


@pytest.mark.parametrize("chunk", [1, 5, 23, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_match_plain_cross_entropy(chunk: int, bias: bool) -> None:
    hidden, weight, b, target = _data(bias=bias)
    # non-uniform per-token weights: any use of the per-token losses differentiates exactly
    w = torch.linspace(0.1, 2.0, hidden.shape[0])
    ref = _reference(hidden, weight, b, target)
    (ref * w).sum().backward()
    ref_grads = [t.grad.clone() for t in (hidden, weight, b) if t is not None]
    for t in (hidden, weight, b):
        if t is not None:
            t.grad = None
    got = chunked_linear_cross_entropy(hidden, weight, b, target, chunk_tokens=chunk)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-6
    assert torch.all(got[::4] == 0)  # ignored tokens
    (got * w).sum().backward()
    for t, r in zip([t for t in (hidden, weight, b) if t is not None], ref_grads):
        assert rel_err(t.grad, r) <= 1e-5


def test_frozen_head_and_no_grad() -> None:
    hidden, weight, _, target = _data(bias=False)
    weight = weight.detach()
    got = chunked_linear_cross_entropy(hidden, weight, None, target, chunk_tokens=4)
    got.sum().backward()
    ref_h = hidden.grad.clone()
    hidden.grad = None
    _reference(hidden, weight, None, target).sum().backward()
    assert rel_err(ref_h, hidden.grad) <= 1e-5
    with torch.no_grad():
        value = chunked_linear_cross_entropy(hidden, weight, None, target, chunk_tokens=4)
    assert not value.requires_grad and rel_err(value, got.detach()) <= 1e-6


def test_bad_inputs() -> None:
    hidden, weight, b, target = _data()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_linear_cross_entropy(hidden, weight, b, target, chunk_tokens=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        chunked_linear_cross_entropy(hidden, weight, b, torch.full_like(target, 31))
    with pytest.raises(ValueError, match="shape"):
        chunked_linear_cross_entropy(hidden, weight, b, target[:-1])
    with pytest.raises(ValueError, match=r"\(V, H\)"):
        chunked_linear_cross_entropy(hidden, weight.t(), b, target)
