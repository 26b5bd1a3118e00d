"""Experimental automatic split (use_sequential_preset=False): chains become a pipelined
RoundPipe; non-sequential models an AutoRoundPipe that trains like plain PyTorch."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hf_tiny import rel_err
from torch import nn

from roundpipe_core import OptimizerCtx, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe_core.autosplit import AutoRoundPipe, TracedOp, auto_wrap, chain_layers

RTOL = 1e-5


class ChainNet(nn.Module):
    """Not an nn.Sequential, but its forward is a chain (with a function step)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.relu(self.body(self.inp(x))))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))  # skip connection: not a chain


class SkipNet(nn.Module):
    """Long skip connection, a parameter used by glue code, a tied input/output matrix."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(3)])
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 5))

    def forward(self, x, extra=None):
        h = self.embed(x)
        first = h
        for block in self.blocks:
            h = block(h)
        h = (h + first) * self.scale
        if extra is not None:
            h = h + extra
        return self.head(h)


def test_chain_detection() -> None:
    steps = chain_layers(ChainNet())
    assert steps is not None and len(steps) == 4 and isinstance(steps[2], TracedOp)
    assert chain_layers(Block(4)) is None
    assert chain_layers(SkipNet()) is None
    assert chain_layers(nn.ModuleList([nn.Linear(2, 2)])) is None


def test_chain_model_becomes_pipelined_roundpipe() -> None:
    torch.manual_seed(0)
    model = ChainNet()
    ref_model = copy.deepcopy(model)
    x, y = torch.randn(6, 6), torch.randn(6, 3)
    nn.functional.mse_loss(ref_model(x), y, reduction="sum").backward()
    rp = wrap_model_to_roundpipe(model, use_sequential_preset=False, split_threshold=100, devices=2)
    try:
        assert type(rp) is RoundPipe
        # body (16*16*2+32 params > 100) was opened: inp, Linear, Tanh, Linear, relu, out
        assert rp.num_layers == 6
        loss = rp.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=lambda o, t: nn.functional.mse_loss(o, t, reduction="sum"),
        )
        assert (
            abs(loss.item() - nn.functional.mse_loss(ref_model(x), y, reduction="sum").item())
            < 1e-4
        )
        for (n, p), rp_ in zip(model.named_parameters(), ref_model.parameters()):
            assert rel_err(rp.master_param(p).grad, rp_.grad) <= RTOL, n
    finally:
        rp.close()


def _train_compare(
    model: nn.Module, make_inputs, loss_fn, rp_kwargs: dict, steps: int = 3
) -> AutoRoundPipe:
    """Train ``model`` through AutoRoundPipe and a deep copy with plain PyTorch; compare.

    After ``step(is_async=True)`` with separate masters the next iteration computes with the
    weights from before that step (published at the next step()), so the reference runs its
    forward on ``view``: ``ref``'s weights without the asynchronous step just taken. With
    shared masters (the default on CPU workers) every step is synchronous."""
    ref = copy.deepcopy(model)
    view = copy.deepcopy(model)
    # SGD, not Adam: Adam turns the rounding noise of gradients that are analytically zero
    # (the key bias of attention) into full-size steps of random sign.
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rp = wrap_model_to_roundpipe(model, use_sequential_preset=False, **rp_kwargs)
    assert isinstance(rp, AutoRoundPipe)
    with OptimizerCtx():
        opt = torch.optim.SGD(rp.parameters(), lr=0.1, momentum=0.9)
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))
    try:
        for it in range(steps):
            inputs = make_inputs(it)
            ref_loss = loss_fn(view(*inputs))
            ref_loss.backward()
            for q, v in zip(ref.parameters(), view.parameters()):
                q.grad, v.grad = v.grad, None
            loss = loss_fn(rp(*inputs))
            assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item()) + 1e-6
            loss.backward()
            # gradients of this iteration equal plain PyTorch's
            named_ref = dict(ref.named_parameters())
            for n, p in model.named_parameters():
                g = rp.master_param(p).grad if p.grad is None else p.grad
                assert g is not None, f"no gradient for {n}"
                assert rel_err(g, named_ref[n].grad) <= RTOL, f"{n} at step {it}"
            is_async = it % 2 == 0
            stale = is_async and not rp.shared_masters
            before = [q.detach().clone() for q in ref.parameters()]
            ref_opt.step()
            ref_opt.zero_grad()
            with torch.no_grad():
                for v, q, b in zip(view.parameters(), ref.parameters(), before):
                    v.copy_(b if stale else q)
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        rp.synchronize()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel_err(p.detach(), q.detach()) <= 1e-5, f"{n} after training"
        return rp
    except BaseException:
        rp.close()
        raise


@pytest.mark.parametrize("shared_masters", [None, False])
def test_skip_connection_model_trains_like_pytorch(shared_masters: bool | None) -> None:
    torch.manual_seed(0)
    model = SkipNet()
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(5, 7, 6, generator=gen), torch.randn(5, 7, 16, generator=gen))
        for _ in range(3)
    ]
    rp = _train_compare(
        model,
        lambda it: data[it],
        lambda out: out.pow(2).mean(),
        dict(
            split_threshold=1200,
            devices=2,
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
            shared_masters=shared_masters,
        ),
    )
    try:
        names = [n for n, _ in rp.units]
        assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"], names
        assert [n for n, _ in rp.host_parameters] == ["scale"]
        assert rp.units[-1][1].num_layers == 2  # the head is a chain: pipelined over 2 layers
        with pytest.raises(TypeError, match="forward_backward"):
            rp.forward_backward(
                input_args=(torch.randn(2, 7, 6),), label=None, loss_fn=lambda o, t: o.sum()
            )
        # inference and the original model are unchanged afterwards
        x = torch.randn(3, 7, 6)
        with torch.no_grad():
            assert rel_err(rp(x), model(x)) <= RTOL
        assert "forward" not in vars(model.blocks[0])
    finally:
        rp.close()


def test_encoder_decoder_trains_like_pytorch() -> None:
    torch.manual_seed(0)
    model = nn.Transformer(
        d_model=16,
        nhead=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=24,
        dropout=0.0,
        batch_first=True,
    )
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(4, 9, 16, generator=gen)
    tgt = torch.randn(4, 6, 16, generator=gen)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(6)
    target = torch.randn(4, 6, 16, generator=gen)
    rp = _train_compare(
        model,
        lambda it: (src + it, tgt, None, tgt_mask),
        lambda out: (out - target).pow(2).mean(),
        dict(devices=3, split_threshold=2000),
        steps=2,
    )
    try:
        assert len(rp.units) >= 4 and rp.num_devices == 3
    finally:
        rp.close()


def test_a_parameter_shared_between_units_keeps_them_apart() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a[0].weight  # shared between two subtrees

        def forward(self, x):
            return self.b(self.a(x)) + x

    torch.manual_seed(0)
    model = Tied()
    rp = wrap_model_to_roundpipe(model, use_sequential_preset=False, split_threshold=5, devices=1)
    try:
        # each unit adds its gradient into the one master: no merge up to the root
        assert [n for n, _ in rp.units] == ["a", "b"]
        ref = copy.deepcopy(model)
        x = torch.randn(3, 4)
        ref(x).sum().backward()
        rp(x).sum().backward()
        assert rel_err(rp.master_param(model.b.weight).grad, ref.b.weight.grad) <= RTOL
    finally:
        rp.close()


class HybridLayer(nn.Module):
    def __init__(self, shared: nn.Module, d: int) -> None:
        super().__init__()
        self.shared = shared
        self.own = Block(d)

    def forward(self, x):
        return self.own(self.shared(x)) + x  # not a chain: opened into its blocks


class ReusedBlockNet(nn.Module):
    """One block held by two layers (as Zamba2's shared transformer block)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        shared = Block(d)
        self.layers = nn.ModuleList([HybridLayer(shared, d), HybridLayer(shared, d)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_module_reached_twice_is_one_unit_called_twice() -> None:
    torch.manual_seed(0)
    model = ReusedBlockNet()
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randn(5, 4, 8, generator=gen),) for _ in range(2)]
    rp = _train_compare(
        model,
        lambda it: data[it],
        lambda out: out.pow(2).mean(),
        dict(split_threshold=300, devices=2, model_run_config=RoundPipeRunConfig(num_microbatch=2)),
        steps=2,
    )
    try:
        names = [n for n, _ in rp.units]
        assert names == ["layers.0.shared", "layers.0.own", "layers.1.own", "head"], names
    finally:
        rp.close()


class StackedExperts(nn.Module):
    """Llama4's experts: rows come as (experts x tokens, d), viewed per expert."""

    def __init__(self, experts: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d, d) / d**0.5)

    def forward(self, x):
        e, d = self.weight.shape[0], self.weight.shape[1]
        return torch.bmm(x.view(e, -1, d), self.weight).view(-1, d)


class ExpertsNet(nn.Module):
    def __init__(self, experts: int = 3, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.experts = StackedExperts(experts, d)

    def forward(self, x):
        e = self.experts.weight.shape[0]
        tokens = self.proj(x).reshape(-1, x.shape[-1])
        routed = torch.cat([tokens * (i + 1) for i in range(e)])  # a copy per expert
        out = self.experts(routed).view(e, -1, x.shape[-1]).sum(0)
        return out.view_as(x) + x


def test_a_unit_whose_input_dim0_is_not_the_batch_is_not_cut_as_batch() -> None:
    torch.manual_seed(0)
    model = ExpertsNet()
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(5, 4, 8, generator=gen),) for _ in range(2)]
    rp = _train_compare(
        model,
        lambda it: data[it],
        lambda out: out.pow(2).mean(),
        dict(
            split_threshold=100,
            lower_threshold=0,
            devices=2,
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
        ),
        steps=2,
    )
    try:
        assert [n for n, _ in rp.units] == ["proj", "experts"]
        assert rp._unsplit_units == {"experts"}  # (3 x 20 tokens, 8): whole, not cut in two
    finally:
        rp.close()


class HelperReader(nn.Module):
    """Uses its child's weight in a helper method, not in forward itself: the source scan
    cannot see it, the watch over the host code finds it."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)
        self.other = nn.Linear(d, d)

    def _mix(self, h):
        return nn.functional.linear(h, self.lin.weight) * 2

    def forward(self, h):
        return self.other(self._mix(h)) + h


class HelperReaderNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.reader = HelperReader(d)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.reader(h) + h)


@pytest.mark.parametrize("shared_masters", [None, False])
def test_a_units_weight_the_host_code_uses_is_trained(
    shared_masters: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = HelperReaderNet()
    gen = torch.Generator().manual_seed(6)
    data = [(torch.randn(5, 4, 6, generator=gen),) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="roundpipe_core.autosplit"):
        rp = _train_compare(
            model,
            lambda it: data[it],
            lambda out: out.pow(2).mean(),
            dict(
                split_threshold=100,
                lower_threshold=0,
                devices=2,
                model_run_config=RoundPipeRunConfig(num_microbatch=2),
                shared_masters=shared_masters,
            ),
            steps=2,
        )
    try:
        assert "reader.lin" in [n for n, _ in rp.units]
        assert [n for n, _ in rp.host_parameters] == ["reader.lin.weight"]
        assert "'reader.lin.weight', a parameter of unit 'reader.lin'" in caplog.text
        assert "override_config={model.reader: RoundPipeRunConfig()}" in caplog.text
    finally:
        rp.close()


def test_bad_threshold() -> None:
    with pytest.raises(ValueError, match="split_threshold"):
        wrap_model_to_roundpipe(SkipNet(), use_sequential_preset=False, split_threshold=0)


#: a lower threshold no module reaches: no module is kept whole for its own parameters
NO_LOWER = 10**9


def _skipnet_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 5, 6, generator=gen), torch.randn(4, 5, 16, generator=gen))] * 2


def test_upper_threshold_in_bytes_cuts_like_the_same_threshold_in_parameters() -> None:
    torch.manual_seed(0)
    by_bytes = wrap_model_to_roundpipe(
        SkipNet(),
        use_sequential_preset=False,
        upper_threshold=1200 * 4,
        lower_threshold=NO_LOWER,
        devices=1,
    )
    by_params = wrap_model_to_roundpipe(
        SkipNet(),
        use_sequential_preset=False,
        split_threshold=1200,
        lower_threshold=NO_LOWER,
        devices=1,
    )
    try:
        assert [n for n, _ in by_bytes.units] == [n for n, _ in by_params.units]
        assert [n for n, _ in by_bytes.units] == [
            "embed",
            "blocks.0",
            "blocks.1",
            "blocks.2",
            "head",
        ]
    finally:
        by_bytes.close()
        by_params.close()


def test_lower_threshold_keeps_big_owners_whole_and_runs_small_units_unsplit() -> None:
    torch.manual_seed(0)
    model = SkipNet()
    cfg = RoundPipeRunConfig(num_microbatch=2)
    # the root owns `scale` (16 floats = 64 bytes): at 64 bytes it becomes one unit
    rp = auto_wrap(model, upper_threshold=1200 * 4, lower_threshold=64, devices=1)
    try:
        assert [n for n, _ in rp.units] == [""] and rp.host_parameters == []
    finally:
        rp.close()
    # at 65 bytes the root is opened; units under 65 bytes run as one microbatch
    rp = auto_wrap(
        model, upper_threshold=1200 * 4, lower_threshold=1000, model_run_config=cfg, devices=1
    )
    try:
        got = []
        for (n, inner), unit in zip(rp.units, rp._unit_modules):
            nbytes = sum(p.numel() * 4 for p in unit.parameters())
            got.append(inner.model_run_config.num_microbatch)
            assert got[-1] == (1 if nbytes < 1000 else 2), (n, nbytes, got[-1])
        assert set(got) == {1, 2}  # both kinds occur in this model
    finally:
        rp.close()


def test_skipped_module_stays_on_the_host_and_trains_like_pytorch() -> None:
    torch.manual_seed(0)
    model = SkipNet()
    data = _skipnet_data()
    rp = _train_compare(
        model,
        lambda it: data[it],
        lambda out: out.pow(2).mean(),
        dict(split_threshold=1200, devices=2, skip_modules=[model.head]),
        steps=2,
    )
    try:
        assert "head" not in [n for n, _ in rp.units]
        assert [n for n, _ in rp.host_parameters] == [
            "scale",
            "head.0.weight",
            "head.0.bias",
            "head.1.weight",
            "head.1.bias",
        ]
    finally:
        rp.close()


def test_override_config_makes_its_module_one_unit_with_that_config() -> None:
    torch.manual_seed(0)
    model = SkipNet()
    special = RoundPipeRunConfig(num_microbatch=3)
    data = _skipnet_data()
    rp = _train_compare(
        model,
        lambda it: data[it],
        lambda out: out.pow(2).mean(),
        dict(
            upper_threshold=100,
            lower_threshold=NO_LOWER,
            devices=2,
            override_config={model.blocks[1]: special},
        ),
        steps=2,
    )
    try:
        units = dict(rp.units)
        assert units["blocks.1"].model_run_config.num_microbatch == 3
        assert not any(n.startswith("blocks.1.") for n in units)  # one unit, not opened
        assert any(n.startswith("blocks.0.") for n in units)  # its sibling was opened
    finally:
        rp.close()


def test_split_options_are_checked() -> None:
    model = SkipNet()
    with pytest.raises(ValueError, match="not a submodule"):
        auto_wrap(model, skip_modules=[nn.Linear(2, 2)], devices=1)
    with pytest.raises(ValueError, match="not a submodule"):
        auto_wrap(model, override_config={nn.Linear(2, 2): RoundPipeRunConfig()}, devices=1)
    with pytest.raises(ValueError, match="no forward of its own"):
        auto_wrap(model, override_config={model.blocks: RoundPipeRunConfig()}, devices=1)
    with pytest.raises(ValueError, match="not both"):
        auto_wrap(model, split_threshold=10, upper_threshold=10, devices=1)
    with pytest.raises(TypeError, match="upper_threshold"):
        auto_wrap(model, upper_threshold=1.5, devices=1)
    with pytest.raises(TypeError, match="override_config"):
        auto_wrap(model, override_config={model.head: "fast"}, devices=1)
