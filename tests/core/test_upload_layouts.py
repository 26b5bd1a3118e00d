"""A worker's cached skeletons and stage layouts follow what the host modules become
between calls: flags, attributes, replaced parameters and submodules, frozen weights."""

from __future__ import annotations

import copy

import pytest
import torch
from _util import assert_close_rel, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.running.devices.cpu import CPUWorker
from roundpipe_core.running.transfer import download_grads, release_stage, upload_stage


class _Scaled(nn.Module):
    """A layer whose forward reads a plain attribute that may be added after wrapping."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * getattr(self, "scale", 1.0)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), nn.Dropout(0.5), _Scaled(), nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    )


def _cfg(run_type: str = "fused") -> RoundPipeRunConfig:
    # two stages of two layers on one worker: every call uploads each stage again
    return RoundPipeRunConfig(
        num_microbatch=2, execute_plan=ModelExecutePlan.uniform(4, 2, run_type)
    )


def _infer(rp: RoundPipe, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return rp(x, roundpipe_run_config=_cfg("infer"))


def test_inference_follows_the_host_modules_between_calls() -> None:
    model = _model()
    rp = RoundPipe(model, devices="cpu:1", model_run_config=_cfg())
    x = torch.randn(4, 6)
    try:
        rp.model.eval()  # dropout off: each change below shows in the output exactly
        for change in (
            lambda m: None,
            lambda m: setattr(m[2], "scale", 3.0),  # an attribute added
            lambda m: setattr(m[2], "scale", 0.5),  # and changed
            lambda m: setattr(m[0], "weight", nn.Parameter(torch.randn(6, 6))),  # replaced
            lambda m: setattr(m[3], "1", nn.Sigmoid()),  # a submodule replaced
            lambda m: m[0].weight.data.mul_(2),  # the values, in place
        ):
            change(model)
            with torch.no_grad():
                expected = model(x)
            assert_close_rel(_infer(rp, x), expected, what="output after a host change")
        model.train()  # dropout back on: the replicas follow the flag
        with torch.no_grad():
            train_out = _infer(rp, x)
        assert not torch.equal(train_out, expected)
        model[1].p = 0.0  # and its probability
        assert_close_rel(_infer(rp, x), expected, what="output with p = 0")
    finally:
        rp.close()


def test_a_parameter_frozen_between_calls_gets_no_gradient() -> None:
    model = _model()
    model[1].p = 0.0
    reference = copy.deepcopy(model)
    rp = RoundPipe(model, devices="cpu:1", model_run_config=_cfg())
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    try:
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        masters = dict(rp.optim_named_parameters())
        assert masters["2.lin.weight"].grad is not None
        for p in masters.values():
            p.grad = None
        model[2].lin.weight.requires_grad_(False)
        reference[2].lin.weight.requires_grad_(False)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert masters["2.lin.weight"].grad is None
        sum_sq(reference(x), y).backward()
        assert_close_rel(masters["0.weight"].grad, reference[0].weight.grad, what="0.weight")
        model[2].lin.weight.requires_grad_(True)  # and thawed again, it takes one
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        assert masters["2.lin.weight"].grad is not None
    finally:
        rp.close()


def test_an_upload_holds_one_device_tensor_per_distinct_host_tensor_of_a_layer() -> None:
    """Tied weights inside a layer are uploaded once; their gradient is downloaded once."""
    torch.manual_seed(0)
    emb = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = emb.weight

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = emb, head

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(t))

    layer = Tied()
    worker = CPUWorker(0)
    try:
        stage = upload_stage(worker, [layer], range(1))
        replica = stage.layer(0)
        assert replica.emb.weight is replica.head.weight
        assert worker.ledger.current["param"] == emb.weight.nbytes
        replica(torch.tensor([[1, 2]])).sum().backward()
        got: list[tuple[torch.Tensor, torch.Tensor]] = []
        download_grads(stage, lambda ps, gs: got.extend(zip(ps, gs)))
        assert len(got) == 1 and got[0][0] is emb.weight
        release_stage(stage)
        assert worker.ledger.current["param"] == 0
        with pytest.raises(KeyError):
            stage.layer(1)
    finally:
        worker.close()


def test_uploaded_parameters_are_parameters_with_the_hosts_flags() -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    layer[0].bias.requires_grad_(False)
    worker = CPUWorker(0)
    try:
        for _ in range(2):  # a fresh layout, then the cached one
            stage = upload_stage(worker, [layer], range(1))
            replica = stage.layer(0)
            for name, p in replica.named_parameters():
                host = layer.get_parameter(name)
                assert type(p) is nn.Parameter and p.is_leaf, name
                assert p.requires_grad == host.requires_grad, name
                assert torch.equal(p, host) and p.data_ptr() != host.data_ptr(), name
            for name, b in replica.named_buffers():
                assert type(b) is torch.Tensor, name  # buffers stay plain tensors
                assert torch.equal(b, layer.get_buffer(name)), name
            release_stage(stage)
    finally:
        worker.close()


def test_a_stages_gradients_leave_the_device_once_and_exactly() -> None:
    """The CPU backend hands the accumulated gradients over (host memory already); the
    generic take_out copies them, as a device download does."""
    from roundpipe_core.running.devices.base import Worker

    class Copying(CPUWorker):
        def copy_out(self, tensors):  # a device's: real copies
            return [t.detach().clone() for t in tensors]

        def take_out(self, tensors):  # the base class's: a download copy
            return Worker.take_out(self, tensors)

    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    expected = torch.autograd.grad(layer(x).sum(), [layer.weight, layer.bias])
    for cls, same in ((CPUWorker, True), (Copying, False)):
        worker = cls(0)
        try:
            stage = upload_stage(worker, [layer], range(1))
            replica = stage.layer(0)
            replica(x).sum().backward()
            on_device = [replica.weight.grad, replica.bias.grad]
            got: list[tuple[torch.Tensor, torch.Tensor]] = []
            download_grads(stage, lambda ps, gs, out=got: out.extend(zip(ps, gs)))
            assert [p for p, _ in got] == [layer.weight, layer.bias]
            for (_, g), d, e in zip(got, on_device, expected):
                assert (g is d) == same
                assert torch.equal(g, e)
            release_stage(stage)
        finally:
            worker.close()
