"""A job's gradients reach the run's buffer in one call (GradBuffer.add_many) with the
same result as one add per gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe_core.running.transfer import batched_sink
from roundpipe_core.stepping.pipelined import GradBuffer

pytestmark = pytest.mark.host_only


def _setup() -> tuple[list[nn.Parameter], dict[int, nn.Parameter]]:
    host = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(3)]
    masters = [nn.Parameter(torch.zeros(3)) for _ in host[:2]]  # host[2] has no master
    # host[1] is tied to host[0]'s master
    return host, {id(host[0]): masters[0], id(host[1]): masters[0]}


def _grads() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(3, dtype=torch.bfloat16) for _ in range(3)]


def test_add_many_equals_one_add_each() -> None:
    host, master_of = _setup()
    one, many = GradBuffer(master_of), GradBuffer(master_of)
    for _ in range(2):
        for p, g in zip(host, _grads()):
            one.add(p, g)
        many.add_many(host, _grads())
    a, b = one.take(), many.take()
    assert [m for m, _ in a] == [m for m, _ in b] and len(a) == 1
    assert b[0][1].dtype == torch.float32
    assert torch.equal(a[0][1], b[0][1])
    g = _grads()
    assert torch.equal(b[0][1], 2 * (g[0].float() + g[1].float()))


def test_the_batched_form_is_found_only_for_a_buffers_add() -> None:
    buffer = GradBuffer({})
    assert batched_sink(buffer.add) == buffer.add_many
    assert batched_sink(buffer.take) != buffer.add_many  # not an add
    # any other sink gets a loop that calls it once per gradient, in order
    seen: list[tuple[int, int]] = []
    batched_sink(lambda p, g: seen.append((p, g)))([1, 2], [3, 4])  # type: ignore[arg-type]
    assert seen == [(1, 3), (2, 4)]


def test_an_add_replaced_after_the_fact_still_sees_every_gradient() -> None:
    host, master_of = _setup()
    seen: list[torch.Tensor] = []

    class Probe(GradBuffer):
        def add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
            seen.append(grad)
            super().add(param, grad)

    probe = Probe(master_of)
    probe.add_many(host, _grads())
    assert len(seen) == 3 and len(probe.take()) == 1
