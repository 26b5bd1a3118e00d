"""wrap_model_to_roundpipe with the published RoundPipe's arguments: ``None`` tries the
preset and falls back to the automatic split, thresholds are bytes, every argument is checked."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from roundpipe_core import RoundPipe, RoundPipeRunConfig
from roundpipe_core.autosplit import AutoRoundPipe
from roundpipe_core.presets import NoPresetError, wrap_model_to_roundpipe


class Chain(nn.Module):
    """Not an nn.Sequential and without a preset, but a chain the automatic split opens."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.c = nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))


def test_none_falls_back_to_the_automatic_split() -> None:
    model = Chain()
    rp = wrap_model_to_roundpipe(model, devices=2)  # default use_sequential_preset=None
    try:
        assert isinstance(rp, RoundPipe) and rp.num_layers > 1
        x = torch.randn(3, 8)
        with torch.no_grad():
            assert torch.allclose(rp(x), model(x), atol=1e-6)
    finally:
        rp.close()
    with pytest.raises(NoPresetError) as info:
        wrap_model_to_roundpipe(Chain(), use_sequential_preset=True, devices=1)
    # both spellings of "no preset": ours (ValueError) and the published one (NotImplementedError)
    assert isinstance(info.value, ValueError) and isinstance(info.value, NotImplementedError)
    assert "Chain" in str(info.value) and "LlamaForCausalLM" in str(info.value)
    assert str(info.value).count("cannot be converted by structure") == 1  # said once


def test_none_uses_the_preset_when_there_is_one(caplog) -> None:
    pytest.importorskip("transformers")
    from hf_tiny import make_model

    model = make_model("llama")
    with caplog.at_level(logging.INFO, logger="roundpipe_core.presets"):
        rp = wrap_model_to_roundpipe(model, devices=1)
    try:
        assert rp.num_layers == 5 and rp.config is model.config  # input adapter, 3 blocks, head
        assert "preset" in caplog.text and "LlamaForCausalLM" in caplog.text
    finally:
        rp.close()


def test_thresholds_are_bytes() -> None:
    """upper_threshold counts bytes: fp32 parameters take 4 each, so N*4 bytes splits like
    N parameters; the default is the model's bytes / (devices + 1), as upstream."""

    def layers(**kwargs) -> int:
        rp = wrap_model_to_roundpipe(Chain(), use_sequential_preset=False, devices=1, **kwargs)
        try:
            return rp.num_layers
        finally:
            rp.close()

    body = sum(p.numel() for p in Chain().b.parameters())  # 2112 parameters
    assert layers(upper_threshold=(body - 1) * 4) == layers(split_threshold=body - 1) == 6
    assert layers(upper_threshold=body * 4) == layers(split_threshold=body) == 4
    total_bytes = sum(p.numel() * 4 for p in Chain().parameters())
    assert layers() == layers(upper_threshold=total_bytes // 2)  # 1 device: bytes / 2
    assert total_bytes // 2 < body * 4  # ... which opens the body


def test_argument_errors() -> None:
    m = Chain()
    cases = [
        (dict(use_sequential_preset="yes"), TypeError, "use_sequential_preset"),
        (dict(lower_threshold=-1), ValueError, "lower_threshold"),
        (dict(lower_threshold=1.5), TypeError, "lower_threshold"),
        (dict(upper_threshold=0), ValueError, "upper_threshold"),
        (dict(upper_threshold=True), TypeError, "upper_threshold"),
        (dict(upper_threshold=64, split_threshold=16), ValueError, "not both"),
        (dict(skip_modules=m.a), TypeError, "skip_modules"),
        (dict(skip_modules=[m.a, "b"]), TypeError, "skip_modules"),
        (dict(override_config=[m.a]), TypeError, "override_config"),
        (dict(override_config={m.a: 1}), TypeError, "override_config"),
        (dict(model_run_config={"num_microbatch": 2}), TypeError, "model_run_config"),
        (dict(name=3), TypeError, "name"),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            wrap_model_to_roundpipe(m, devices=1, **kwargs)
    with pytest.raises(TypeError, match="nn.Module"):
        wrap_model_to_roundpipe(lambda x: x)  # type: ignore[arg-type]


def test_split_options_reach_the_automatic_split() -> None:
    """skip_modules / override_config / lower_threshold are passed on to the automatic
    split (and honoured there); valid empty values and a preset path are accepted."""
    m = Chain()
    rp = wrap_model_to_roundpipe(
        m,
        use_sequential_preset=False,
        devices=1,
        skip_modules=[m.a],
        override_config={m.b: RoundPipeRunConfig(num_microbatch=1)},
        lower_threshold=1024,
    )
    try:
        assert isinstance(rp, AutoRoundPipe)
        assert [n for n, _ in rp.host_parameters] == ["a.weight", "a.bias"]
        assert dict(rp.units)["b"].model_run_config.num_microbatch == 1
    finally:
        rp.close()
    rp = wrap_model_to_roundpipe(
        m, use_sequential_preset=False, devices=1, skip_modules=(), override_config={}, name="x"
    )
    try:
        assert not isinstance(rp, AutoRoundPipe) and rp.name == "x"
    finally:
        rp.close()
