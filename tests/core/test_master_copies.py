"""The masters' gradient merge and the copy back to the model: the same values, in the
same order of additions, as a per-tensor loop -- without copies a loop would not make."""

from __future__ import annotations

import pytest
import torch
from _util import mlp

from roundpipe_core.stepping.masters import MasterWeights

pytestmark = pytest.mark.host_only


def _grads(masters: MasterWeights, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m.shape, generator=g).to(dtype) for m in masters.params()]


def test_merge_keeps_the_first_gradient_itself():
    masters = MasterWeights(mlp(), torch.float32)
    grads = _grads(masters, 0)
    masters.add_many(zip(masters.params(), grads))
    for m, g in zip(masters.params(), grads):
        assert m.grad is g  # no copy and no zero-filled buffer it was added into


def test_merge_accumulates_exactly_as_a_loop_in_order():
    masters = MasterWeights(mlp(), torch.float32)
    ms = masters.params()
    first, second, third = _grads(masters, 1), _grads(masters, 2), _grads(masters, 3)
    masters.add_many(zip(ms, [g.clone() for g in first]))
    # a batch naming every master twice (second, then third): the order of additions
    # decides the fp32 rounding, so it must be the loop's
    masters.add_many(list(zip(ms, second)) + list(zip(ms, third)))
    for m, a, b, c in zip(ms, first, second, third):
        expect = a.clone().add_(b).add_(c)
        assert torch.equal(m.grad, expect)


def test_merge_of_another_dtype_adds_in_the_masters_dtype():
    masters = MasterWeights(mlp(), torch.float32)
    ms = masters.params()
    base, low = _grads(masters, 4), _grads(masters, 5, torch.bfloat16)
    masters.add_many(zip(ms, [g.clone() for g in base]))
    masters.add_many(zip(ms, low))
    for m, a, b in zip(ms, base, low):
        assert m.grad.dtype == torch.float32
        assert torch.equal(m.grad, a + b.float())


def test_a_converted_gradient_reuses_memory_only_once_nobody_holds_it():
    masters = MasterWeights(mlp(), torch.float32)
    ms = masters.params()
    low = _grads(masters, 7, torch.bfloat16)
    masters.add_many(zip(ms, low))
    kept = [m.grad for m in ms]  # someone holds the first step's gradients
    for m in ms:
        m.grad = None  # zero_grad(set_to_none=True)
    masters.add_many(zip(ms, _grads(masters, 8, torch.bfloat16)))
    for m, k, g in zip(ms, kept, low):
        assert torch.equal(k, g.float())  # never written while held
        assert m.grad.data_ptr() != k.data_ptr()
    ptrs = {m.grad.data_ptr() for m in ms} | {k.data_ptr() for k in kept}
    del kept
    for m in ms:
        m.grad = None
    again = _grads(masters, 9, torch.bfloat16)
    masters.add_many(zip(ms, again))
    for m, g in zip(ms, again):
        assert m.grad.data_ptr() in ptrs  # memory written before, not a fresh tensor
        assert m.grad.dtype == torch.float32 and m.grad.shape == m.shape
        assert torch.equal(m.grad, g.float())


def test_copy_to_model_writes_every_parameter_and_casts_like_copy_():
    for dtype in (torch.float32, torch.bfloat16):
        model = mlp().to(dtype)
        masters = MasterWeights(model, torch.float32)
        with torch.no_grad():
            for m, g in zip(masters.params(), _grads(masters, 6)):
                m.add_(g)  # a step's new values, not representable in bf16
        masters.copy_to_model()
        for _, p, m in masters.entries:
            assert p.dtype == dtype
            assert torch.equal(p, m.detach().to(dtype))  # round to nearest, as p.copy_(m)


class _TaggedParameter(torch.nn.Parameter):
    """A parameter subclass (as some libraries use): copied on its own, not batched."""


def test_copy_to_model_covers_parameter_subclasses_too():
    model = mlp()
    first = model[0]
    first.weight = _TaggedParameter(first.weight.detach().clone())
    masters = MasterWeights(model, torch.float32)
    with torch.no_grad():
        for m in masters.params():
            m.add_(1.0)
    masters.copy_to_model()
    assert type(first.weight) is _TaggedParameter
    for _, p, m in masters.entries:
        assert torch.equal(p, m)
