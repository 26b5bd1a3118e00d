"""The host-memory budget's lines beside the state (``running/host_memory.py``): the
pages of a file the weights are mapped from, and the CPU workers' saved activations.
Each is checked against the bytes it stands for, and against the budget's total."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe
from roundpipe_core.running.host_memory import estimate_host_memory, mapped_file_bytes

W = 64
PAGE = 4096


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(W, W) for _ in range(4)])


def _rows_total(budget) -> int:
    return sum(b for _, b in budget.rows())


def _mapped_net(tmp_path) -> tuple[nn.Sequential, int, torch.Tensor]:
    """A net whose first layer's weight is a view of a mapped file (as a checkpoint
    loaded with mmap leaves it), the rest of the file being a tensor the net does not
    hold (as the bf16 source of a quantized weight): (net, file size, the filler)."""
    net = _net()
    filler = torch.zeros(64 * 1024)  # 256 KiB: pages the net never holds
    path = tmp_path / "ckpt.pt"
    torch.save({"w": net[0].weight.detach().clone(), "filler": filler}, path)
    loaded = torch.load(path, mmap=True, weights_only=True)
    net[0].weight = nn.Parameter(loaded["w"], requires_grad=False)
    return net, path.stat().st_size, loaded["filler"]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_mapped_file_pages_beyond_the_weights_in_them(tmp_path) -> None:
    net, size, filler = _mapped_net(tmp_path)
    mapping = -(-size // PAGE) * PAGE
    inside = net[0].weight.numel() * 4
    found = mapped_file_bytes(list(net.parameters()))
    assert found.inside == inside
    assert found.extra == mapping - inside
    del filler
    # anonymous tensors are in no file
    assert mapped_file_bytes([torch.zeros(1000)]).extra == 0

    budget = estimate_host_memory(net, optimizer="adamw")
    assert budget.mapped_files == mapping - inside
    assert budget.total == _rows_total(budget)
    assert ("mapped file pages", mapping - inside) in budget.rows()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_mapped_pages_read_already_are_allocated_not_process(tmp_path) -> None:
    """The mapped pages resident now exist already: they are neither still to allocate
    nor part of the process line (which would count them twice)."""
    net, _, filler = _mapped_net(tmp_path)
    float(filler.sum())  # read every page of the filler: resident now
    plain = estimate_host_memory(_net(), optimizer="adamw")
    budget = estimate_host_memory(net, optimizer="adamw")
    resident = mapped_file_bytes(list(net.parameters())).resident
    assert resident >= filler.numel() * 4
    assert budget.already_allocated == budget.weights + resident - net[0].weight.numel() * 4
    # the process line is the same whether the weights are mapped or not (the RSS
    # rises by the mapped pages, which the budget counts as allocated)
    assert abs(budget.process - plain.process) < 4 * 2**20


def test_worker_activations_one_microbatch_of_the_largest_autograd_stage() -> None:
    """Per worker: the largest stage it runs with autograd (one microbatch's saved
    bytes); forward stages of a training call save only their input."""
    rp = RoundPipe(_net(), devices="cpu:2", optim_dtype=torch.float32)
    try:
        plan = ModelExecutePlan()
        # forward: [0-1] on worker 0, [2-3] on worker 1; backward (round-robin on from
        # there): fused [3] on worker 0, [1-2] on worker 1, [0] on worker 0
        plan.fwd_plan = [range(0, 2), range(2, 4)]
        plan.bwd_plan = [range(3, 4), range(1, 3), range(0, 1)]
        acts = [100.0, 200.0, 400.0, 800.0]
        budget = estimate_host_memory(
            rp, optimizer="adamw", plan=plan, num_microbatch=3, layer_activation_bytes=acts
        )
        assert budget.worker_activations == 800 + (200 + 400)
        assert budget.total == _rows_total(budget)
        assert ("worker activations", 1400) in budget.rows()
        none = estimate_host_memory(rp, optimizer="adamw", plan=plan, num_microbatch=3)
        assert none.worker_activations == 0  # not measured yet, none given
        assert budget.total - none.total == 1400
        with pytest.raises(ValueError, match="one number per layer"):
            estimate_host_memory(rp, plan=plan, layer_activation_bytes=[1.0])
        with pytest.raises(ValueError, match="byte counts >= 0"):
            estimate_host_memory(rp, plan=plan, layer_activation_bytes=[1.0, -1, 2, 3])
    finally:
        rp.close()


def test_worker_activations_default_to_what_the_first_training_call_measured() -> None:
    rp = RoundPipe(_net(), devices="cpu:2", optim_dtype=torch.float32)
    try:
        x = torch.randn(8, W)
        rp.forward_backward((x,), loss_fn=lambda out, _: out.square().sum())
        rp.synchronize()
        measured = rp.layer_activation_bytes
        assert measured is not None and sum(measured) > 0
        plan = ModelExecutePlan()
        plan.fwd_plan, plan.bwd_plan = [], [range(0, 4)]
        budget = estimate_host_memory(rp, optimizer="adamw", plan=plan)
        # one fused stage of all layers: one microbatch's graph on each worker running
        # one of its replicas (CPU workers computing side by side), else on one worker
        replicas = 2 if rp.pool.cpu_overlap else 1
        assert budget.worker_activations == replicas * int(sum(measured))
    finally:
        rp.close()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_every_mapping_of_the_file_counts(tmp_path) -> None:
    """A file mapped twice (or one mapping the kernel split) holds pages in each part:
    all mappings of a file that holds a weight count, not only the one the weight is in."""
    net, size, filler = _mapped_net(tmp_path)
    again = torch.load(tmp_path / "ckpt.pt", mmap=True, weights_only=True)  # a second mapping
    mapping = -(-size // PAGE) * PAGE
    inside = net[0].weight.numel() * 4
    assert mapped_file_bytes(list(net.parameters())).extra == 2 * mapping - inside
    del again, filler
