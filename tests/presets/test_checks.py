"""Forward-rule violation detection (seed 004): writes to plain attributes, parameters
and shared buffers are reported with the layer index and attribute name."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from roundpipe_core.checks import ForwardRuleChecker, check_forward_rules, find_shared_buffers

pytestmark = pytest.mark.host_only


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


class Appender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return x


class Cfg:
    def __init__(self) -> None:
        self.scale = 1.0


class ConfigWriter(nn.Module):
    def __init__(self, cfg: Cfg) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, x):
        self.cfg.scale = 2.0
        return x * self.cfg.scale


class OwnBuffer(nn.Module):
    """Allowed: writes a buffer that belongs to this layer alone, reads plain attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(4))
        self.factor = 3

    def forward(self, x):
        out = self.lin(x) * self.factor
        self.acc.add_(out.detach().mean(0))
        return out


class SharedWriter(nn.Module):
    def __init__(self, shared: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", shared)

    def forward(self, x):
        self.table.add_(1.0)
        return x + self.table


class ParamWriter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(0.5)
        return x * self.w


def _warnings_of(layer_index, module, shared=()):
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        check_forward_rules(layer_index, module, lambda: module(x), shared)
    return [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize(
    "module, needle",
    [
        (Counter(), "'calls'"),
        (Appender(), "'seen'"),
        (ConfigWriter(Cfg()), "'cfg'"),
        (ParamWriter(), "parameter 'w'"),
    ],
)
def test_violations_are_named(module, needle) -> None:
    msgs = _warnings_of(7, module)
    assert len(msgs) == 1, msgs
    assert "layer 7" in msgs[0] and needle in msgs[0]


def test_allowed_writes_are_quiet() -> None:
    assert _warnings_of(0, OwnBuffer()) == []
    assert _warnings_of(0, nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))) == []


def test_shared_buffer_write_detected_and_error_mode() -> None:
    table = torch.zeros(4)
    layers = [SharedWriter(table), SharedWriter(table), OwnBuffer()]
    shared = find_shared_buffers(layers)
    assert shared == [{"table"}, {"table"}, set()]
    msgs = _warnings_of(1, layers[1], shared[1])
    assert len(msgs) == 1 and "shared buffer 'table'" in msgs[0] and "layer 1" in msgs[0]
    with pytest.raises(ValueError, match="layer 0"):
        check_forward_rules(
            0, layers[0], lambda: layers[0](torch.ones(1, 4)), shared[0], error=True
        )


def test_checker_checks_each_layer_once() -> None:
    layers = [Counter(), OwnBuffer()]
    checker = ForwardRuleChecker(layers)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            checker.run(0, layers[0], lambda: layers[0](x))
            checker.run(1, layers[1], lambda: layers[1](x))
    assert len([w for w in rec if "layer 0" in str(w.message)]) == 1
    assert layers[0].calls == 3


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2", "qwen3_moe"])
def test_presets_follow_the_rules(kind: str) -> None:
    pytest.importorskip("transformers")
    from hf_tiny import make_batch, make_model

    from roundpipe_core.context import RecomputeStore, running_layer
    from roundpipe_core.presets import convert_to_sequential

    seq = convert_to_sequential(make_model(kind))
    layers = list(seq)
    shared = find_shared_buffers(layers)
    ids, mask, labels = make_batch(padding="left")
    store = RecomputeStore()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with running_layer(0, 0, False, store, torch.device("cpu")):
            x = check_forward_rules(
                0,
                layers[0],
                lambda: layers[0](input_ids=ids, attention_mask=mask, labels=labels),
                shared[0],
            )
        for i in range(1, len(layers)):
            with running_layer(i, 0, False, store, torch.device("cpu")):
                x = check_forward_rules(i, layers[i], lambda: layers[i](x), shared[i])  # noqa: B023
    assert [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)] == []
