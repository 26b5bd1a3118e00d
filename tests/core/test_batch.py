"""Microbatch split / merge over pytrees, and custom split/merge functions."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch
from _util import mlp, sum_sq

from roundpipe_core import RoundPipe, RoundPipeRunConfig
from roundpipe_core.batch import default_split_input, merge_outputs, split_sizes, sum_merge_output


def test_split_sizes_near_equal_and_capped_by_batch():
    assert split_sizes(7, 3) == [3, 2, 2]
    assert split_sizes(2, 5) == [1, 1]
    assert split_sizes(None, 4) == [0]
    with pytest.raises(ValueError):
        split_sizes(0, 2)


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: str


Point = namedtuple("Point", ["x", "y"])


def test_split_pytrees_broadcasts_non_batch_leaves():
    x = torch.arange(10).reshape(5, 2)
    args = ([x, {"k": x * 2}], Pair(x + 1, "s"), Point(x, 3), torch.ones(3))
    parts = default_split_input(args, {"w": x, "flag": True}, 2)
    assert len(parts) == 2
    (a0, k0), (a1, k1) = parts
    assert torch.equal(a0[0][0], x[:3]) and torch.equal(a1[0][1]["k"], (x * 2)[3:])
    assert isinstance(a0[1], Pair) and a0[1].b == "s" and torch.equal(a1[1].a, (x + 1)[3:])
    assert isinstance(a0[2], Point) and a0[2].y == 3
    assert torch.equal(a0[3], torch.ones(3))  # leading size 3 != batch 5: broadcast
    assert k0["flag"] is True and torch.equal(k1["w"], x[3:])


def test_sum_merge_concatenates_and_sums_scalars():
    outs = [
        {"h": torch.ones(2, 3), "loss": torch.tensor(1.0), "n": "x"},
        {"h": torch.zeros(1, 3), "loss": torch.tensor(2.0), "n": "x"},
    ]
    m = sum_merge_output(outs)
    assert m["h"].shape == (3, 3) and m["loss"].item() == 3.0 and m["n"] == "x"


def test_hf_model_output_splits_and_merges():
    transformers = pytest.importorskip("transformers")
    out_cls = transformers.modeling_outputs.CausalLMOutput
    o = out_cls(logits=torch.randn(4, 2, 3))
    parts = default_split_input((o,), {}, 2)
    assert isinstance(parts[0][0][0], out_cls) and parts[0][0][0].logits.shape == (2, 2, 3)
    merged = merge_outputs(None, [p[0][0] for p in parts])
    assert torch.equal(merged.logits, o.logits)


def test_custom_split_label_and_merge_functions_are_used():
    model = mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    calls = {"split_input": 0, "split_label": 0, "merge": 0}

    def split_input(args, kwargs, n):
        calls["split_input"] += 1
        return [((args[0][:2],), {}), ((args[0][2:],), {})]

    def split_label(label, n):
        calls["split_label"] += 1
        assert n == 2
        return [label[:2], label[2:]]

    def merge(outs):
        calls["merge"] += 1
        return torch.cat(outs)

    rp = RoundPipe(model, devices="cpu:2")
    try:
        cfg = RoundPipeRunConfig(
            split_input=split_input, split_label=split_label, merge_output=merge
        )
        loss, out = rp.forward_backward(
            (x,), label=y, loss_fn=sum_sq, return_outputs=True, run_config=cfg
        )
        assert calls == {"split_input": 1, "split_label": 1, "merge": 1}
        assert out.shape == (6, 4)
        assert torch.allclose(loss, sum_sq(out, y), rtol=1e-5)
        with pytest.raises(ValueError, match="merge_output"):
            rp(x, roundpipe_run_config=cfg)  # cannot differentiate through a custom merge
    finally:
        rp.close()
