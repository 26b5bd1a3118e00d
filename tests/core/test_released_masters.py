"""Released masters (``MasterWeights.release``, what a sharded host state does with the
masters another rank owns): a few bytes each, never copied into the model -- by the copy
after a step nor by the layer-by-layer publication --, still collecting gradients, and
a RoundPipe holding them refuses an asynchronous step."""

from __future__ import annotations

import pytest
import torch
from _util import mlp

from roundpipe_core import RoundPipe
from roundpipe_core.stepping.masters import MasterWeights
from roundpipe_core.stepping.versions import WeightVersions

WHY = "pass is_async=False (the test's reason)"


def _bf16_masters() -> tuple[torch.nn.Sequential, MasterWeights]:
    model = mlp().to(torch.bfloat16)
    return model, MasterWeights(model, torch.float32)


def test_release_frees_the_values_and_keeps_the_parameter():
    model, masters = _bf16_masters()
    ms = masters.params()
    shapes = [m.shape for m in ms]
    freed = masters.release(ms[::2], WHY)
    assert freed == sum(m.numel() * 4 for m in ms[::2])
    for m, shape in zip(ms, shapes):
        assert m.shape == shape and m.dtype == torch.float32  # the optimizer's parameter
    assert all(m.untyped_storage().nbytes() <= 4 for m in ms[::2])
    assert all(m.untyped_storage().nbytes() == m.numel() * 4 for m in ms[1::2])
    released = ms[0]
    masters.add_grad(next(model.parameters()), torch.ones(released.shape))
    assert torch.equal(released.grad, torch.ones(released.shape))  # gradients still collect
    with pytest.raises(RuntimeError, match="single memory location"):
        with torch.no_grad():
            released.copy_(torch.ones(released.shape))  # a stray write fails loudly
    assert masters.sync_only == WHY


def test_released_masters_are_not_copied_into_the_model():
    model, masters = _bf16_masters()
    params = [p for p in model.parameters()]
    ms = masters.params()
    masters.release(ms[:2], WHY)
    with torch.no_grad():
        for p in params:
            p.fill_(7.0)  # what the owner's all-gather wrote
        for m in ms[2:]:
            m.fill_(1.0)
    masters.copy_to_model()
    assert all(torch.all(p == 7.0) for p in params[:2])
    assert all(torch.all(p == 1.0) for p in params[2:])
    # the publication of a step's weights, layer by layer, skips them the same way
    with torch.no_grad():
        for m in ms[2:]:
            m.fill_(2.0)
    versions = WeightVersions(list(model), masters.entries, masters.released)
    versions.publish(1, lambda: False)
    assert all(torch.all(p == 7.0) for p in params[:2])
    assert all(torch.all(p == 2.0) for p in params[2:])


def test_restore_gives_values_back_from_the_model():
    model, masters = _bf16_masters()
    ms = masters.params()
    masters.release(ms, WHY)
    assert masters.restore_released() == len(ms)
    for _, p, m in masters.copies:
        assert torch.equal(m, p.float())
    assert not masters.released and masters.sync_only is None


def test_a_roundpipe_with_released_masters_refuses_an_async_step():
    rp = RoundPipe(mlp().to(torch.bfloat16), optim_dtype=torch.float32, devices="cpu:1")
    try:
        rp.masters.release(rp.optim_parameters()[:1], WHY)
        with pytest.raises(ValueError, match="the test's reason"):
            rp.step(lambda: None, is_async=True)
        with pytest.raises(ValueError, match="the test's reason"):
            rp.step_layerwise(lambda params: None, None, is_async=True)
        rp.step(lambda: None, is_async=False)  # synchronous: fine
    finally:
        rp.close()


def test_owning_every_master_still_makes_the_steps_synchronous():
    """A rank that owns all the separate masters releases none, but its peers' steps are
    synchronous: its own must be too (the collectives would not match otherwise)."""
    _, masters = _bf16_masters()
    assert masters.release([], WHY) == 0
    assert masters.sync_only == WHY and not masters.released
    shared = MasterWeights(mlp(), torch.float32, share=True)  # fp32: every master shared
    shared.release(shared.params(), WHY)
    assert shared.sync_only is None and not shared.released  # nothing separate to shard


def test_attach_takes_the_step_kind_as_a_bool():
    """``DataParallel.attach(..., async_step=...)`` decides whether a sharded rank keeps
    every master (asynchronous) or its share only: anything but a bool is refused; in one
    process nothing is released either way."""
    from roundpipe_core.distributed import DataParallel

    rp = RoundPipe(mlp().to(torch.bfloat16), optim_dtype=torch.float32, devices="cpu:1")
    try:
        dp = DataParallel(shard_host_state=True)
        with pytest.raises(TypeError, match="async_step must be True or False"):
            dp.attach(rp, [], async_step="yes")  # type: ignore[arg-type]
        for is_async in (True, False):
            dp.attach(rp, [], async_step=is_async)
            assert dp.keeps_masters is is_async and not rp.masters.released
        dp.detach()
    finally:
        rp.close()
