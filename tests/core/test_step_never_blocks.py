"""An asynchronous step never blocks a device.

``step(is_async=True)`` runs on the optimizer thread while the next call computes.
The gradients that call downloads must not enter the masters' ``.grad`` before the
step has read the previous ones, but the devices must not wait for that: a worker
hands the merge to the optimizer thread and goes on with its next job.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _util import assert_close_rel, mlp, sum_sq

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core import model as model_module
from roundpipe_core.stepping.pipelined import GradBuffer

_STEP_WAIT_S = 20.0


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def test_gradient_downloads_of_the_next_call_do_not_wait_for_the_step(monkeypatch):
    """With a grad hook registered (the data-parallel path), the step in flight waits for
    an event only the next call's last gradient download sets: a worker that waited for
    the step before going on would never get there (the step gives up after a timeout)."""
    model = mlp()
    first = model[0].weight
    downloaded = threading.Event()

    class Recording(GradBuffer):
        def add(self, param, grad):
            super().add(param, grad)
            if param is first:
                downloaded.set()

    monkeypatch.setattr(model_module, "GradBuffer", Recording)
    # three backward stages on two devices: the device that would block holds later jobs
    plan = ModelExecutePlan.uniform(len(model), 3, "fused")
    rp = RoundPipe(
        model,
        devices="cpu:2",
        shared_masters=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan),
    )
    reported: list[int] = []
    rp.register_grad_hook(lambda masters: reported.extend(id(m) for m in masters))
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
    seen_in_time: list[bool] = []
    grads_at_step: list[torch.Tensor] = []

    def step_waiting_for_the_next_call() -> None:
        seen_in_time.append(downloaded.wait(_STEP_WAIT_S))
        grads_at_step.append(rp.optim_parameters()[0].grad.clone())
        opt.step()
        opt.zero_grad()

    (x1, y1), (x2, y2) = _batches(2)
    try:
        rp.forward_backward((x1,), label=y1, loss_fn=sum_sq)
        g1 = rp.optim_parameters()[0].grad.clone()
        downloaded.clear()
        rp.step(step_waiting_for_the_next_call, is_async=True)
        rp.forward_backward((x2,), label=y2, loss_fn=sum_sq)
        assert seen_in_time == [True], "the devices waited for the optimizer step"
        # the step saw only the first call's gradients; the second call's are in .grad now
        assert torch.equal(grads_at_step[0], g1)
        rp.synchronize()
        n_masters = len(rp.optim_parameters())
        assert len(reported) == 2 * n_masters  # every master reported once per call
    finally:
        rp.close()


def test_merges_behind_the_step_keep_the_blocking_math():
    """Grad hooks on or off, the same sequence of async steps gives the same weights."""

    def train(hook: bool):
        model = mlp()
        rp = RoundPipe(
            model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=3)
        )
        if hook:
            rp.register_grad_hook(lambda masters: None)
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
        try:
            for k, (x, y) in enumerate(_batches(6, seed=4)):
                rp.forward_backward((x,), label=y, loss_fn=sum_sq)
                if k % 2 == 1:  # accumulate over two calls
                    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
            rp.synchronize()
            return [p.detach().clone() for p in model.parameters()]
        finally:
            rp.close()

    for a, b in zip(train(True), train(False)):
        assert_close_rel(a, b, 1e-6)


def test_weights_are_published_layer_by_layer():
    """A run waiting for layer 0's new weights gets them while a deeper layer's copy is
    still in progress: publication does not hold every layer back until the last copy."""
    import time

    from roundpipe_core.running.devices.pool import PoolError
    from roundpipe_core.stepping.masters import MasterWeights
    from roundpipe_core.stepping.versions import WeightVersions

    model = mlp()
    layers = list(model.children())
    masters = MasterWeights(model, torch.float32)
    versions = WeightVersions(layers, masters.entries)
    release = threading.Event()

    class _SlowCopy:
        """Stands in for the deepest layer's weight: its copy waits for ``release``."""

        def __init__(self, p):
            self.p = p

        def copy_(self, src):
            release.wait(_STEP_WAIT_S)
            return self.p.copy_(src)

    deepest = masters.entries[-1]
    key = id(deepest[2])
    versions._pair[key] = (_SlowCopy(deepest[1]), deepest[2])
    with torch.no_grad():
        for _, _, m in masters.entries:
            m.add_(1.0)  # step 1's weights
    reader = versions.register(1, [range(0, 1)])
    errors: list[BaseException] = []

    def publish():
        try:
            versions.publish(1, lambda: False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    deadline = time.monotonic() + _STEP_WAIT_S / 4  # well before the slow copy gives up
    try:
        versions.wait_ready(reader, [0], lambda: time.monotonic() > deadline or release.is_set())
        assert not release.is_set()
        for p in layers[0].parameters():
            assert torch.equal(p, masters.master_of[id(p)])  # layer 0 holds step 1 already
    except PoolError:
        pytest.fail("layer 0 was not published before the deepest layer's copy ended")
    finally:
        release.set()
        t.join(_STEP_WAIT_S)
    assert not errors
    for _, p, m in masters.entries:
        assert torch.equal(p, m)
