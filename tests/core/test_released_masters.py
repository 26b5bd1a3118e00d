"""Released masters (``MasterWeights.release``, what a sharded host state does with the
masters another rank owns): a few bytes each, never copied into the model -- by the copy
after a step nor by the layer-by-layer publication --, still collecting gradients, and
a RoundPipe holding them refuses an asynchronous step -- unless their versions are
published by a remote publisher (a rank sharding for asynchronous steps), which each
publication of a version runs once, part by part, as older readers let go."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _util import mlp

from roundpipe_core import RoundPipe
from roundpipe_core.running.devices.pool import PoolError
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
    """``DataParallel.attach(..., async_step=...)`` decides when a sharded rank's released
    masters reach its model (inside the step, or when the step's weights are published):
    anything but a bool is refused; in one process nothing is released either way."""
    from roundpipe_core.distributed import DataParallel

    rp = RoundPipe(mlp().to(torch.bfloat16), optim_dtype=torch.float32, devices="cpu:1")
    try:
        dp = DataParallel(shard_host_state=True)
        with pytest.raises(TypeError, match="async_step must be True or False"):
            dp.attach(rp, [], async_step="yes")  # type: ignore[arg-type]
        for is_async in (True, False):
            dp.attach(rp, [], async_step=is_async)
            assert not dp.publishes_versions and not rp.masters.released
            assert not rp.masters.publishers
        dp.detach()
    finally:
        rp.close()


class _Recorder:
    """A remote publisher as a sharded rank's is (``HostShard.publish``): all its masters
    in parts, in forward order, each claimed before its weights are written and marked after;
    what it writes is ``version`` itself, so a test sees which version reached the model."""

    def __init__(self, model: torch.nn.Sequential, masters: MasterWeights) -> None:
        self.pairs = [(p, m) for _, p, m in masters.copies]
        self.calls: list[int] = []
        self.events: list[tuple[str, int]] = []

    @property
    def keys(self) -> list[int]:
        return [id(m) for _, m in self.pairs]

    def publish(self, version, claim, mark) -> None:
        self.calls.append(version)
        for i, (p, m) in enumerate(self.pairs):
            claim([id(m)])
            self.events.append(("write", i))
            with torch.no_grad():
                p.fill_(float(version))
            mark([id(m)])


def _published_model(num_layers: int = 3):
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(num_layers)])
    model.to(torch.bfloat16)
    masters = MasterWeights(model, torch.float32)
    masters.release(masters.params(), None)  # every master another rank's
    rec = _Recorder(model, masters)
    masters.publishers.append(rec)
    versions = WeightVersions(list(model), masters.entries, masters.released, masters.publishers)
    return model, masters, versions, rec


def test_released_masters_for_async_steps_leave_the_step_asynchronous():
    _, masters = _bf16_masters()
    masters.release(masters.params()[:2], None)
    assert masters.sync_only is None and len(masters.released) == 2


def test_a_remote_publisher_publishes_each_version_once():
    """Every publication of a version runs the remote publisher first, once per version
    (its broadcasts must match the other ranks'): a later publication of the same version
    -- the next step's after a synchronize() -- finds its masters published."""
    model, _, versions, rec = _published_model()
    versions.publish(1, lambda: False)
    assert rec.calls == [1]
    assert all(torch.all(p == 1.0) for p in model.parameters())
    versions.publish(1, lambda: False)
    versions.publish_remote(1, lambda: False)
    assert rec.calls == [1]
    versions.publish_remote(2, lambda: False)  # synchronize()'s path
    versions.publish(2, lambda: False)
    assert rec.calls == [1, 2]
    assert all(v == 2 for v in versions.version.values())
    assert [i for _, i in rec.events[:6]] == [0, 1, 2, 3, 4, 5]


def test_a_remote_publication_waits_for_older_readers_of_each_part():
    """A part is written only once no call reading an older version still has to upload
    its layer, and after that call's upload fence: the first layers while the old call
    still needs the last one, the last one once it uploaded it."""
    model, _, versions, rec = _published_model()
    old = versions.register(0, [range(0, 3), range(2, 3)])  # uploads layer 2 twice
    fenced: list[int] = []
    versions.uploaded(old, [0, 1], lambda: fenced.append(1))
    done = threading.Event()
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            versions.publish(1, lambda: False)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=publish)
    t.start()
    deadline = time.monotonic() + 10
    while len(rec.events) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # would it go on to layer 2? it must not
    assert [i for _, i in rec.events] == [0, 1, 2, 3], rec.events  # layers 0 and 1
    assert fenced == [1, 1, 1, 1]  # each written part waited for the old upload's fence
    assert not done.is_set()
    last = list(model[2].parameters())
    assert all(torch.all(p != 1.0) for p in last)  # the old call still reads them
    versions.uploaded(old, [2], lambda: None)
    time.sleep(0.1)
    assert not done.is_set()  # uploads layer 2 once more
    versions.uploaded(old, [2], lambda: None)
    assert done.wait(10) and not errors, errors
    t.join()
    assert all(torch.all(p == 1.0) for p in model.parameters())


def test_a_failure_stops_a_remote_publication_that_waits():
    _, _, versions, rec = _published_model()
    versions.register(0, [range(0, 3)])  # never uploads
    with pytest.raises(PoolError, match="a pipelined iteration failed"):
        versions.publish(1, lambda: True)
    assert rec.events == []
