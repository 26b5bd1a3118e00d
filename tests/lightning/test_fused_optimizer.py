"""``fuse_optimizer=True`` (the default): the user's torch optimizer runs torch's fused
CPU kernel on the masters -- the same trajectory as the unfused run, within fp32 rounding."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from rpl_helpers import SeqModule, loader, max_rel_err, params_of, rp_trainer

STEPS = 6
TOL = 1e-6


class Built(SeqModule):
    """SeqModule whose optimizer is built by ``make(params)``; records the optimizer
    the strategy hands to the training loop."""

    def __init__(self, make: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.make = make
        self.seen_groups: list[dict[str, Any]] = []

    def configure_optimizers(self) -> Any:
        opt = self.make(self.parameters())
        sch = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}

    def on_train_start(self) -> None:
        opt = self.optimizers().optimizer
        self.seen_groups = [dict(g, params=None) for g in opt.param_groups]
        self.seen_class = type(opt).__name__


MAKERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


@pytest.mark.parametrize("async_step", [False, True])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_fused_trajectory_equals_unfused(name: str, async_step: bool) -> None:
    runs = {}
    for fuse in (True, False):
        m = Built(MAKERS[name])
        rp_trainer(
            max_steps=STEPS, async_step=async_step, strategy_kw={"fuse_optimizer": fuse}
        ).fit(m, loader())
        assert all(bool(g["fused"]) is fuse for g in m.seen_groups), m.seen_groups
        runs[fuse] = params_of(m)
    assert max_rel_err(runs[True], runs[False]) <= TOL
    # and it trained
    assert max_rel_err(runs[True], params_of(Built(MAKERS[name]))) > 1e-3


def test_no_fused_kernel_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="roundpipe_lightning.session")
    for _ in range(2):
        m = Built(lambda ps: torch.optim.RMSprop(ps, lr=1e-3))
        rp_trainer(max_steps=1).fit(m, loader())
        assert all(g.get("fused") is None for g in m.seen_groups)
    said = [r.getMessage() for r in caplog.records if "unfused" in r.getMessage()]
    assert len(said) == 1 and "no fused CPU kernel for RMSprop" in said[0], said


def test_explicit_choice_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="roundpipe_lightning.session")
    m = Built(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=False))
    rp_trainer(max_steps=1).fit(m, loader())
    assert all(g["fused"] is False for g in m.seen_groups)
    m = Built(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True))
    rp_trainer(max_steps=1).fit(m, loader())
    assert all(g["foreach"] is True and not g["fused"] for g in m.seen_groups)


def test_fuse_optimizer_must_be_bool() -> None:
    from roundpipe_lightning import RoundPipeStrategy

    with pytest.raises(TypeError, match="fuse_optimizer"):
        RoundPipeStrategy(fuse_optimizer="yes")  # type: ignore[arg-type]


class _MySGD(torch.optim.SGD):
    """A user's subclass (e.g. one that logs or sleeps in ``step``)."""


class _PlainDescent(torch.optim.Optimizer):
    """A third-party optimizer the host-memory table cannot know."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


def test_optimizer_subclasses_and_unknown_optimizers_train() -> None:
    """Setup's host-memory budget must not refuse an optimizer it cannot classify: a
    subclass counts its torch base's state, an unknown class is assumed Adam-sized."""
    runs = {}
    for name, make in {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
        "subclass": lambda ps: _MySGD(ps, lr=0.05),
        "unknown": lambda ps: _PlainDescent(ps, lr=0.05),
    }.items():
        m = Built(make)
        if name == "unknown":
            with pytest.warns(UserWarning, match="cannot tell how much state _PlainDescent"):
                rp_trainer(max_steps=STEPS).fit(m, loader())
        else:
            rp_trainer(max_steps=STEPS).fit(m, loader())
        runs[name] = params_of(m)
    assert max_rel_err(runs["subclass"], runs["sgd"]) <= TOL
    assert max_rel_err(runs["unknown"], runs["sgd"]) <= TOL
    assert max_rel_err(runs["sgd"], params_of(Built(MAKERS["sgd"]))) > 1e-3
