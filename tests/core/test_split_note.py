"""A layer's error names the inputs the automatic split cut (issue 23 item 14): a
per-feature tensor as long as the batch is cut like the batch, and the shape error it
causes says so and points to ``split_input`` specs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from roundpipe_core import RoundPipe, RoundPipeRunConfig
from roundpipe_core.batch import Replicate, split_call_inputs

BATCH, WIDTH = 8, 8  # the per-feature vector is as long as the batch


class ScaledLinear(nn.Module):
    """Layer 0: ``lin(x) * scale`` with a per-feature ``scale`` of shape ``(WIDTH,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None, **kw: Any) -> Any:
        scale = kw["extra"]["scale"] if scale is None else scale
        return self.lin(x) * scale


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(ScaledLinear(), nn.Tanh(), nn.Linear(WIDTH, 2))


@pytest.fixture
def rp() -> Any:
    r = RoundPipe(_model(), devices=2)
    yield r
    r.close()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.rand(WIDTH, generator=g)


CFG = RoundPipeRunConfig(num_microbatch=3)


def _note(exc: BaseException) -> str:
    notes = [n for n in getattr(exc, "__notes__", []) if "split into microbatches" in n]
    assert len(notes) == 1, getattr(exc, "__notes__", None)
    return notes[0]


def test_the_forward_error_names_the_cut_leaf_and_points_to_specs(rp: Any) -> None:
    x, scale = _inputs()
    for grad in (True, False):  # the autograd forward and the inference run
        with (
            torch.set_grad_enabled(grad),
            pytest.raises(RuntimeError, match="size of tensor") as info,
        ):
            rp(x, scale, roundpipe_run_config=CFG)
        note = _note(info.value)
        assert "batch size is 8, from args[0] (8, 8)" in note
        assert "args[1] (8,) -> (3,) (3,) (2,)" in note
        assert "split_input" in note and "Replicate" in note and "Run configuration" in note


def test_forward_backward_errors_name_a_nested_keyword_leaf(rp: Any) -> None:
    x, scale = _inputs()
    y = torch.zeros(BATCH, 2)
    with pytest.raises(RuntimeError, match="size of tensor") as info:
        rp.forward_backward(
            input_args=(x,),
            input_kwargs={"extra": {"scale": scale}},
            label=y,
            loss_fn=nn.functional.mse_loss,
            run_config=CFG,
        )
    assert "kwargs['extra']['scale'] (8,) -> (3,) (3,) (2,)" in _note(info.value)
    assert all(p.grad is None for p in rp.optim_parameters())  # the failed call left nothing


def test_the_spec_the_note_points_to_runs_the_call_as_plain_pytorch(rp: Any) -> None:
    x, scale = _inputs()
    cfg = RoundPipeRunConfig(num_microbatch=3, split_input=((None, Replicate), {}))
    with torch.no_grad():
        got = rp(x, scale, roundpipe_run_config=cfg)
        want = _model()[0](x, scale)
        want = _model()[2](torch.tanh(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_note_when_only_the_batch_was_cut(rp: Any) -> None:
    """One cut tensor gave the batch size itself: nothing to doubt, no note."""
    x, _ = _inputs()
    with torch.no_grad(), pytest.raises(RuntimeError, match="size of tensor") as info:
        rp(x, torch.rand(5), roundpipe_run_config=CFG)  # (5,): broadcast, not cut
    assert not any("split into microbatches" in n for n in getattr(info.value, "__notes__", []))
    with torch.no_grad(), pytest.raises(KeyError) as info:
        rp(x, roundpipe_run_config=CFG)  # scale missing: the layer's own error
    assert not any("split into microbatches" in n for n in getattr(info.value, "__notes__", []))


def test_split_records_what_the_automatic_rule_cut() -> None:
    x, scale = _inputs()
    split = split_call_inputs(None, (x, scale, 3), {"m": {"s": scale}, "k": None}, 3)
    assert [leaf.path for leaf in split.auto_cut] == ["args[0]", "args[1]", "kwargs['m']['s']"]
    assert split.auto_cut[1].shape == (8,) and split.auto_cut[1].sizes == (3, 3, 2)
    spec = split_call_inputs(((None, Replicate, None), None), (x, scale, 3), {}, 3)
    assert [leaf.path for leaf in spec.auto_cut] == ["args[0]"]  # a spec'd leaf is not listed


def test_an_overlapped_call_reports_the_cut_too(rp: Any) -> None:
    x, scale = _inputs()
    pending = rp.forward_backward(
        input_args=(x, scale),
        label=torch.zeros(BATCH, 2),
        loss_fn=nn.functional.mse_loss,
        run_config=CFG,
        blocking=False,
    )
    with pytest.raises(RuntimeError, match="size of tensor") as info:
        pending.result()
    assert "args[1] (8,) -> (3,) (3,) (2,)" in _note(info.value)
