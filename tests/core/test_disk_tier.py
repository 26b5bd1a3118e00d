"""The disk tier (``RoundPipe(offload_dir=PATH)``): the masters and the optimizer state in
files, streamed by the layer-wise step -- the same weights, bit for bit, as the run in
RAM; a bounded buffer; write, then publish; a clear refusal of what it cannot do."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _util import mlp, sum_sq

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.stepping import disk_tier
from roundpipe_core.stepping.layerwise import step_subset

MAKERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _rp(dtype: torch.dtype, offload: Path | None, **kw: Any) -> RoundPipe:
    model = mlp().to(dtype)
    plan = ModelExecutePlan.uniform(len(model), 3, "fused")
    return RoundPipe(
        model,
        optim_dtype=torch.float32,
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
        shared_masters=False,
        offload_dir=offload,
        **kw,
    )


def _train(
    rp: RoundPipe,
    opt: torch.optim.Optimizer,
    steps: int,
    blocking: bool,
    is_async: bool,
    accumulate: int = 1,
    sched: Any = None,
    seed: int = 0,
) -> None:
    pending = []
    for k, (x, y) in enumerate(_batches(steps * accumulate, seed)):
        x = x.to(rp.model[0].weight.dtype)
        y = y.to(rp.model[0].weight.dtype)
        pending.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=blocking))
        if (k + 1) % accumulate:
            continue
        rp.step_layerwise(functools.partial(step_subset, opt), opt.zero_grad, is_async=is_async)
        if sched is not None:
            rp.after_step(sched.step)
    for r in pending:
        if not blocking:
            r.result()
    rp.synchronize()


def _weights(rp: RoundPipe) -> list[torch.Tensor]:
    return [p.detach().clone() for p in rp.model.parameters()]


def _run(
    tmp: Path | None, name: str, dtype: torch.dtype, **kw: Any
) -> tuple[list[torch.Tensor], RoundPipe, torch.optim.Optimizer]:
    rp = _rp(dtype, tmp)
    opt = MAKERS[name](rp.optim_parameters())
    _train(rp, opt, **kw)
    return _weights(rp), rp, opt


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_weights_equal_the_run_in_ram(tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    kw = {"steps": 3, "blocking": True, "is_async": True}
    ref, rp0, _ = _run(None, name, dtype, **kw)
    got, rp1, _ = _run(tmp_path, name, dtype, **kw)
    try:
        _assert_same(got, ref)
    finally:
        rp0.close()
        rp1.close()


@pytest.mark.parametrize(
    "kw",
    [
        {"blocking": True, "is_async": False},
        {"blocking": False, "is_async": True},
        {"blocking": False, "is_async": True, "accumulate": 2},
        {"blocking": True, "is_async": True, "accumulate": 2},
    ],
    ids=["sync", "overlapped", "overlapped-accumulate", "accumulate"],
)
def test_sync_overlapped_and_accumulated_steps_equal_ram(tmp_path: Path, kw: dict) -> None:
    ref, rp0, _ = _run(None, "adamw", torch.bfloat16, steps=3, **kw)
    got, rp1, _ = _run(tmp_path, "adamw", torch.bfloat16, steps=3, **kw)
    try:
        _assert_same(got, ref)
    finally:
        rp0.close()
        rp1.close()


def test_a_scheduler_gives_the_same_weights(tmp_path: Path) -> None:
    out = []
    for path in (None, tmp_path):
        rp = _rp(torch.float32, path)
        opt = MAKERS["adamw"](rp.optim_parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        _train(rp, opt, steps=3, blocking=True, is_async=True, sched=sched)
        out.append(_weights(rp))
        rp.close()
    _assert_same(out[1], out[0])


def test_masters_and_state_are_not_resident_between_steps(tmp_path: Path) -> None:
    _, rp, opt = _run(tmp_path, "adamw", torch.bfloat16, steps=2, blocking=True, is_async=True)
    try:
        assert not opt.state  # all on disk
        for m in rp.optim_parameters():
            assert m.untyped_storage().nbytes() <= 4  # the zero-stride placeholder
        tier = rp.disk_tier
        assert tier is not None and tier.gen == 2
        assert tier.peak_resident <= tier.limit
    finally:
        rp.close()
    assert not any(tmp_path.iterdir())  # the store is removed at close


def test_the_buffer_holds_at_most_buffer_layers(tmp_path: Path) -> None:
    """Counted, not timed: the bytes of records alive at once (read ahead, stepping,
    being written) never pass two layers' worth with ``buffer_layers=2``, over steps that
    read and write every layer."""
    rp = RoundPipe(mlp(num_layers=8), devices="cpu:1", shared_masters=False)
    tier = disk_tier.DiskTier(tmp_path, rp.masters, rp.layers, buffer_layers=2)
    try:
        opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
        for m in rp.optim_parameters():
            m.grad = torch.ones(m.shape)
        for _ in range(3):
            tier.step(opt, rp.optim_parameters(), {})
        # a layer: weight and bias, each record master + exp_avg + exp_avg_sq + step,
        # every tensor under a page: 2 * 4 pages
        layer = 2 * 4 * 4096
        assert 0 < tier.peak_resident <= 2 * layer
        assert tier.gen == 3
        masters = sum(m.numel() * 4 for m in rp.optim_parameters())
        assert tier.bytes_written >= 3 * 3 * masters  # master and two states, each step
    finally:
        tier.close()
        rp.close()


def test_a_full_disk_mid_step_keeps_the_last_good_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rp = _rp(torch.float32, tmp_path)
    opt = MAKERS["adamw"](rp.optim_parameters())
    try:
        _train(rp, opt, steps=2, blocking=True, is_async=False)
        tier = rp.disk_tier
        assert tier is not None
        good = {k: v.clone() for k, v in tier.masters_state().items()}
        good_opt = tier.optimizer_state_dict(opt)["state"]
        good_opt = {k: {n: t.clone() for n, t in v.items()} for k, v in good_opt.items()}
        weights = _weights(rp)
        calls = {"n": 0}
        real = disk_tier._pwrite

        def full(fd: int, buf: torch.Tensor, offset: int) -> None:
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, buf, offset)

        monkeypatch.setattr(disk_tier, "_pwrite", full)
        (x, y), *_ = _batches(1, seed=5)
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.step_layerwise(functools.partial(step_subset, opt), opt.zero_grad, is_async=False)
        pytest.fail("the full disk was not raised")
    except OSError as e:
        assert e.errno == errno.ENOSPC
    monkeypatch.setattr(disk_tier, "_pwrite", real)
    try:
        assert tier.gen == 2  # nothing published
        for k, v in tier.masters_state().items():
            assert torch.equal(v, good[k])
        now = tier.optimizer_state_dict(opt)["state"]
        for k, v in good_opt.items():
            for n, t in v.items():
                assert torch.equal(now[k][n], t)
        rp.synchronize()
        _assert_same(_weights(rp), weights)  # the model holds the last good step
        # and training goes on from there
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)
        rp.step_layerwise(functools.partial(step_subset, opt), opt.zero_grad, is_async=False)
        assert tier.gen == 3
    finally:
        rp.close()


def test_refuses_an_unwritable_or_too_small_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads_before = _roundpipe_threads()
    with pytest.raises(ValueError, match="not a directory"):
        _rp(torch.float32, tmp_path / "missing")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError, match="not writable"):
            _rp(torch.float32, ro)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk_tier.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(ValueError, match=str(tmp_path)) as e:
        _rp(torch.float32, tmp_path)
    assert "GiB free" in str(e.value)
    assert not any(p.name.startswith("roundpipe-tier") for p in tmp_path.iterdir())
    # a refused RoundPipe leaves no worker thread behind (its pool was closed)
    assert _roundpipe_threads() == threads_before


def _roundpipe_threads() -> int:
    return sum(t.name.startswith("roundpipe") for t in threading.enumerate())


def test_unsupported_steps_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shared_masters=False"):
        RoundPipe(mlp(), devices="cpu:1", shared_masters=True, offload_dir=tmp_path)
    rp = _rp(torch.float32, tmp_path)
    opt = MAKERS["adamw"](rp.optim_parameters())
    try:
        with pytest.raises(ValueError, match="step_layerwise"):
            rp.step(opt.step)
        with pytest.raises(ValueError, match="step_subset"):
            rp.step_layerwise(lambda ms: step_subset(opt, ms))
        lbfgs = torch.optim.LBFGS(rp.optim_parameters())
        with pytest.raises(ValueError, match="steps_elementwise"):
            rp.step_layerwise(functools.partial(step_subset, lbfgs))
    finally:
        rp.close()


@pytest.mark.parametrize("direction", ["ram-to-disk", "disk-to-ram"])
def test_a_checkpoint_resumes_across_tiers(tmp_path: Path, direction: str) -> None:
    """Two steps in one tier, a checkpoint in the format of the run in RAM, two more in
    the other tier: the same weights as four steps in RAM."""
    ref, rp0, _ = _run(None, "adamw", torch.bfloat16, steps=4, blocking=True, is_async=True)
    rp0.close()
    first = tmp_path if direction == "disk-to-ram" else None
    second = tmp_path / "b" if direction == "ram-to-disk" else None
    if second is not None:
        second.mkdir()
    rp = _rp(torch.bfloat16, first)
    opt = MAKERS["adamw"](rp.optim_parameters())
    _train(rp, opt, steps=2, blocking=True, is_async=True)
    if rp.disk_tier is not None:
        masters = rp.disk_tier.masters_state()
        opt_state = rp.disk_tier.optimizer_state_dict(opt)
    else:
        masters = dict(rp.optim_named_parameters())
        opt_state = opt.state_dict()
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": rp.model.state_dict(), "masters": masters, "opt": opt_state}, ckpt)
    rp.close()
    state = torch.load(ckpt, weights_only=True)
    rp = _rp(torch.bfloat16, second)
    opt = MAKERS["adamw"](rp.optim_parameters())
    rp.model.load_state_dict(state["model"])
    if rp.disk_tier is not None:
        rp.disk_tier.load_state(state["masters"], opt, state["opt"])
    else:
        named = dict(rp.optim_named_parameters())
        with torch.no_grad():
            for k, v in state["masters"].items():
                named[k].copy_(v)
        opt.load_state_dict(state["opt"])
    try:
        _train(rp, opt, steps=2, blocking=True, is_async=True, seed=0)
        got = _weights(rp)
    finally:
        rp.close()
    ref2, rp0, _ = _two_then_two()
    rp0.close()
    _assert_same(got, ref2)
    del ref


def _two_then_two() -> tuple[list[torch.Tensor], RoundPipe, torch.optim.Optimizer]:
    """Four steps in RAM, the last two on the first two batches again (as the resumed
    runs above train)."""
    rp = _rp(torch.bfloat16, None)
    opt = MAKERS["adamw"](rp.optim_parameters())
    _train(rp, opt, steps=2, blocking=True, is_async=True)
    _train(rp, opt, steps=2, blocking=True, is_async=True)
    return _weights(rp), rp, opt


def test_the_budget_counts_the_tier(tmp_path: Path) -> None:
    from roundpipe_core.running.host_memory import estimate_host_memory

    plain = estimate_host_memory(mlp(), optim_dtype=torch.float32)
    tiered = estimate_host_memory(mlp(), optim_dtype=torch.float32, offload_dir=True)
    assert tiered.masters == tiered.optimizer_state == 0
    assert tiered.gradients == plain.gradients
    # two slots of master + 2 Adam states, 4 B each, at least
    assert tiered.disk >= 2 * 12 * plain.num_params
    assert tiered.tier_buffer > 0 and "on disk (offload_dir)" in str(tiered)
    rp = _rp(torch.bfloat16, tmp_path)
    try:
        built = estimate_host_memory(rp)
        tier = rp.disk_tier
        assert tier is not None
        assert built.masters == built.optimizer_state == 0
        largest = max(m.numel() * 4 for m in rp.optim_parameters())
        assert built.tier_buffer == tier.limit + largest
        assert built.disk == tier.disk_bytes
        store = next(tmp_path.iterdir())
        on_disk = sum(f.stat().st_size for f in store.glob("slot*.bin"))
        assert on_disk <= built.disk  # what the files take (preallocated) is what was told
    finally:
        rp.close()


def test_loading_an_optimizer_state_alone_keeps_the_masters(tmp_path: Path) -> None:
    _, rp, opt = _run(tmp_path, "adamw", torch.bfloat16, steps=2, blocking=True, is_async=True)
    try:
        tier = rp.disk_tier
        assert tier is not None
        before = {k: v.clone() for k, v in tier.masters_state().items()}
        sd = tier.optimizer_state_dict(opt)
        sd = {
            "state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},
            "param_groups": sd["param_groups"],
        }
        tier.load_state(None, opt, sd)
        assert tier.gen == 3
        for k, v in tier.masters_state().items():
            assert torch.equal(v, before[k])
        again = tier.optimizer_state_dict(opt)["state"]
        for k, v in sd["state"].items():
            for n, t in v.items():
                assert torch.equal(again[k][n], t)
    finally:
        rp.close()
