"""roundpipe_core.optim: torch's optimizers under the published names, fastest CPU path.

Every optimizer must follow plain torch (its default implementation) within 1e-6 over
several steps, keep torch's constructor signature, and ``fused_variant`` /
``use_fastest_`` must turn a user's optimizer into the fast one without changing the
trajectory.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from roundpipe_core import optim

pytestmark = pytest.mark.host_only

NAMES = list(optim._IMPL)
EXTRA = {  # non-default options that take other code paths in the kernels
    "Adam": {"weight_decay": 0.1, "amsgrad": True},
    "AdamW": {"weight_decay": 0.1},
    "SGD": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "Adagrad": {"lr_decay": 0.01, "weight_decay": 0.01},
    "RMSprop": {"momentum": 0.5, "centered": True},
    "NAdam": {"decoupled_weight_decay": True, "weight_decay": 0.1},
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(17, 9), (9,), (5, 3, 4), (1,)]
    ]


def _run(make, steps: int = 6) -> list[torch.Tensor]:
    params = _params()
    opt = make(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "name, options",
    [(n, "defaults") for n in NAMES] + [(n, "extra") for n in NAMES if n in EXTRA],
)
def test_matches_plain_torch_within_1e6(name, options):
    kw = EXTRA[name] if options == "extra" else {}
    ours = _run(lambda ps: getattr(optim, name)(ps, **kw))
    ref = _run(lambda ps: getattr(torch.optim, name)(ps, **kw))
    moved = sum(float((a - b).abs().sum()) for a, b in zip(ours, [p.detach() for p in _params()]))
    assert moved > 0  # the parameters did change
    _close(ours, ref)


@pytest.mark.parametrize("name", NAMES)
def test_same_signature_class_and_chosen_impl(name):
    ours, base = getattr(optim, name), getattr(torch.optim, name)
    assert issubclass(ours, base)
    assert inspect.signature(ours) == inspect.signature(base)
    opt = ours(_params())
    impl = optim.fastest_impl(name)
    group = opt.param_groups[0]
    assert bool(group.get("fused")) == (impl == "fused")
    assert bool(group.get("foreach")) == (impl == "foreach")


def test_caller_choice_is_kept_and_fused_falls_back_for_non_float():
    assert optim.Adam(_params(), fused=False).param_groups[0]["fused"] is False
    assert optim.Adam(_params(), foreach=True).param_groups[0]["fused"] is None
    assert optim.Adam(_params(), differentiable=True).param_groups[0]["fused"] is None
    groups = [{"params": _params()[:2], "lr": 0.1}, {"params": _params()[2:]}]
    opt = optim.AdamW(groups, lr=0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    assert all(g["fused"] for g in opt.param_groups)
    named = optim.SGD([("w", _params()[0])])
    assert named.param_groups[0]["fused"] is True
    with pytest.raises(TypeError, match="iterable of Tensors"):
        optim.Adam(torch.zeros(3, requires_grad=True))


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown optimizer 'Lion'"):
        optim.fastest_impl("Lion")


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad", "RMSprop"])
@pytest.mark.parametrize("how", ["fused_variant", "use_fastest_"])
def test_user_optimizer_switched_mid_run_keeps_the_trajectory(name, how, monkeypatch):
    if name == "RMSprop":  # no optimizer measured faster with foreach: test that path anyway
        monkeypatch.setitem(optim._IMPL, name, "foreach")
    kw = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
    ref = _run(lambda ps: getattr(torch.optim, name)(ps, **kw), steps=6)

    params = _params()
    opt = getattr(torch.optim, name)(params, **kw)
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if i == 2:  # switch with state already built
            if how == "fused_variant":
                fast = optim.fused_variant(opt)
                assert fast is not None and isinstance(fast, getattr(torch.optim, name))
                assert fast.param_groups[0]["params"][0] is params[0]
                state_key = next(k for k in opt.state[params[0]] if k != "step")
                assert fast.state[params[0]][state_key] is opt.state[params[0]][state_key]
                opt = fast
            else:
                assert optim.use_fastest_(opt) is True
            key = "fused" if optim.fastest_impl(name) == "fused" else "foreach"
            assert all(grp[key] for grp in opt.param_groups)
    _close([p.detach() for p in params], ref)


def test_no_variant_when_nothing_is_faster_or_the_user_chose():
    ps = _params()
    assert optim.fused_variant(torch.optim.Adamax(ps)) is None  # torch's default is fastest
    assert optim.fused_variant(torch.optim.Adam(ps, foreach=False)) is None  # user's choice
    assert optim.fused_variant(torch.optim.Adam(ps, fused=True)) is None  # already fused
    assert optim.fused_variant(optim.Adam(ps)) is None

    class MyAdam(torch.optim.Adam):
        pass

    assert optim.fused_variant(MyAdam(ps)) is None  # its step may be its own
    ints = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float16)]
    assert optim.fused_variant(torch.optim.SGD(ints)) is not None  # any float dtype fuses
    assert optim.use_fastest_(torch.optim.Rprop(ps, foreach=False)) is False
    # each case says why (what the Lightning strategy logs)
    why = optim.why_not_faster
    assert why(torch.optim.Adamax(ps)) == "torch has no fused CPU kernel for Adamax"
    assert "explicit fused=/foreach=" in why(torch.optim.Adam(ps, foreach=False))
    assert "subclass of Adam" in why(MyAdam(ps))
    assert "not dense floating-point" in why(torch.optim.SGD([torch.zeros(2, dtype=torch.int64)]))
    assert why(torch.optim.Adam(ps)) == ""


def test_an_explicit_fused_false_is_kept() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([p], lr=1e-3, fused=False)
    assert optim.fused_variant(opt) is None
