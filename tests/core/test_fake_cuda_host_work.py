"""What the host does for a CUDA pool besides feeding it (fake CUDA): the optimizer
thread's intra-op threads, and where bf16 gradients become fp32."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.running.devices import pool as pool_mod
from roundpipe_core.running.devices.pool import DevicePool, optimizer_thread_cap


def test_the_optimizer_thread_cap_leaves_a_core_per_gpu_worker() -> None:
    assert optimizer_thread_cap(32, 4) == 28  # the published rule: more than 4 cores each
    assert optimizer_thread_cap(16, 4) is None  # too few cores to give any away
    assert optimizer_thread_cap(2, 1) is None
    assert optimizer_thread_cap(8, 0) is None


def test_a_cuda_pool_caps_the_optimizer_threads(
    fake_cuda: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 32)
    cuda_pool = DevicePool(["cuda:0", "cuda:0"])
    try:
        assert cuda_pool.optimizer_threads() == 30
    finally:
        cuda_pool.close()


@pytest.mark.cpu_backend
def test_a_cpu_pool_keeps_every_core_for_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 32)
    cpu_pool = DevicePool("cpu:2")
    try:
        assert cpu_pool.optimizer_threads() is None
    finally:
        cpu_pool.close()


def test_the_step_runs_with_the_pools_intra_op_threads(
    fake_cuda: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer thread sets its intra-op threads before the first step: a step
    function sees the pool's cap."""
    before = torch.get_num_threads()
    monkeypatch.setattr(DevicePool, "optimizer_threads", lambda self: 1)
    seen: list[int] = []
    rp = RoundPipe(nn.Linear(4, 4), devices=["cuda:0"], pin_model="off")
    try:
        rp.step(lambda: seen.append(torch.get_num_threads()), is_async=False)
    finally:
        rp.close()
        torch.set_num_threads(before)  # the setting is the process's, not the thread's
    assert seen == [1]
    assert pool_mod.optimizer_thread_cap is optimizer_thread_cap


def test_bf16_gradients_become_fp32_off_the_worker_threads(
    fake_cuda: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model with fp32 masters: every bf16 -> fp32 conversion of a gradient runs
    on the thread that merges the call's gradients (here the caller), none on a CUDA
    worker thread, which would stop issuing its GPU's next work meanwhile; the masters'
    gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(6, 4, dtype=torch.bfloat16)
    conversions: list[str] = []
    original_to, original_copy = torch.Tensor.to, torch.Tensor.copy_

    def recording_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original_to(self, *args, **kwargs)
        if self.dtype == torch.bfloat16 and out.dtype == torch.float32:
            conversions.append(threading.current_thread().name)
        return out

    def recording_copy(self: torch.Tensor, src: torch.Tensor, *args: Any) -> torch.Tensor:
        if src.dtype == torch.bfloat16 and self.dtype == torch.float32:  # into reused memory
            conversions.append(threading.current_thread().name)
        return original_copy(self, src, *args)

    rp = RoundPipe(model, devices=["cuda:0", "cuda:0"], pin_model="off", optim_dtype=torch.float32)
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [range(0, 2)], [range(2, 3), range(0, 2)]
    try:
        cfg = RoundPipeRunConfig(num_microbatch=1, execute_plan=plan)
        rp.layer_activation_bytes = [0.0] * 3
        monkeypatch.setattr(torch.Tensor, "to", recording_to)
        monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
        rp.forward_backward(
            (x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum(), run_config=cfg
        )
        rp.synchronize()
        monkeypatch.setattr(torch.Tensor, "to", original_to)
        monkeypatch.setattr(torch.Tensor, "copy_", original_copy)
        got = {n: m.grad for n, m in zip(dict(model.named_parameters()), rp.optim_parameters())}
    finally:
        rp.close()
    on_workers = [n for n in conversions if n.startswith("roundpipe-cuda-")]
    assert not on_workers, on_workers
    assert conversions, "the gradients were never converted"
    ((ref(x) - y) ** 2).sum().backward()
    for name, p in ref.named_parameters():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], p.grad.float(), rtol=0, atol=0, msg=name)
