"""Overlapping consecutive iterations: forward_backward(blocking=False).

The contract: the same parameters, losses and gradients as the same sequence of
blocking calls (with step(is_async=True): one step stale), while a device that
is done with iteration k already runs iteration k+1.
"""

from __future__ import annotations

import time

import pytest
import torch
from _util import assert_close_rel, mlp, sum_sq
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.planning.schedule import BACKWARD, FORWARD, FUSED
from roundpipe_core.planning.simulate import simulate


def _batches(n, seed=0, bs=6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 8, generator=g), torch.randn(bs, 4, generator=g)) for _ in range(n)]


# 6 layers: forward stages hold more layers than backward stages (asymmetric)
ASYMMETRIC = ModelExecutePlan(
    [range(0, 3), range(3, 4)], [range(4, 6), range(2, 4), range(1, 2), range(0, 1)]
)


class _Sleep(nn.Module):
    def forward(self, x):
        time.sleep(0.002)
        return x


def _train(devices, plan, blocking, calls_per_step=1, n=5, is_async=True, slow="step"):
    """``slow="step"``: a slow optimizer step (uploads would outrun the new weights without
    the version gate); ``"layers"``: slow layers (a late backward stage of iteration k
    would upload weights already overwritten for k+1 without the publication fence)."""
    model = mlp()
    if slow == "layers":
        for i in range(len(model)):
            model[i] = nn.Sequential(model[i], _Sleep())
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    # separate masters: the asynchronous, one-step-stale step this file is about
    rp = RoundPipe(model, devices=f"cpu:{devices}", model_run_config=cfg, shared_masters=False)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)

    def slow_step():
        if slow == "step":
            time.sleep(0.02)
        opt.step()
        opt.zero_grad()

    out = []
    try:
        for k, (x, y) in enumerate(_batches(n)):
            out.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=blocking))
            if (k + 1) % calls_per_step == 0:
                rp.step(slow_step, is_async=is_async)
        rp.synchronize()
        losses = [r if blocking else r.result() for r in out]
        grads = {n: m.grad.clone() for n, m in rp.optim_named_parameters() if m.grad is not None}
        return [p.detach().clone() for p in model.parameters()], losses, grads
    finally:
        rp.close()


@pytest.mark.parametrize(
    "devices,plan,calls_per_step,slow",
    [(2, None, 1, "step"), (3, ASYMMETRIC, 1, "layers"), (3, ASYMMETRIC, 2, "step")],
    ids=["2dev-uniform-slowstep", "3dev-asymmetric-slowlayers", "3dev-asymmetric-accumulate"],
)
def test_pipelined_sgd_matches_the_blocking_sequence(devices, plan, calls_per_step, slow):
    ref_params, ref_losses, ref_grads = _train(devices, plan, True, calls_per_step, slow=slow)
    params, losses, grads = _train(devices, plan, False, calls_per_step, slow=slow)
    for a, b in zip(params, ref_params):
        assert_close_rel(a, b, 1e-6, "parameters")
    for a, b in zip(losses, ref_losses):
        assert_close_rel(a, b, 1e-6, "losses")
    assert set(grads) == set(ref_grads)  # leftover grads of the last calls (not stepped)
    for n in grads:
        assert_close_rel(grads[n], ref_grads[n], 1e-6, n)
    # the one-step-stale math is really what ran: fresh weights (is_async=False) differ
    fresh, _, _ = _train(devices, plan, True, calls_per_step, is_async=False, slow="none")
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(params, fresh))
    # and is_async=False stays plain PyTorch math with pipelined calls too
    fresh_pipelined, _, _ = _train(
        devices, plan, False, calls_per_step, is_async=False, slow="none"
    )
    for a, b in zip(fresh_pipelined, fresh):
        assert_close_rel(a, b, 1e-6, "is_async=False")


def test_blocking_calls_mixed_with_pipelined_ones_keep_the_same_math():
    def run(modes):
        model = mlp()
        rp = RoundPipe(
            model, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=3)
        )
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
        try:
            losses = []
            for blocking, (x, y) in zip(modes, _batches(len(modes), seed=1)):
                r = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=blocking)
                rp.step(lambda: (opt.step(), opt.zero_grad()))
                losses.append(r if blocking else r.result())
            rp.synchronize()
            return [p.detach().clone() for p in model.parameters()], losses
        finally:
            rp.close()

    ref, ref_losses = run([True] * 5)
    got, losses = run([False, False, True, False, True])
    for a, b in zip(got + losses, ref + ref_losses):
        assert_close_rel(a, b, 1e-6)


class _Slow(nn.Module):
    """A layer with a fixed floor of compute time, so stages are long enough to
    see the ordering of jobs from different iterations."""

    def __init__(self, width=12, in_width=None, delay=0.002):
        super().__init__()
        self.lin = nn.Linear(in_width or width, width)
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        return torch.tanh(self.lin(x))


# fused stage 4-5 (job 1), then backward stages of one layer each; on three workers,
# round-robin puts iteration k+1's forward (job 0) on worker 0, free once k's job 3 is
# done, while k's last two backward stages (layers 1 and 0) still run on workers 1 and 2
OVERLAP_PLAN = ModelExecutePlan(
    [range(0, 4)], [range(4, 6), range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
)


def test_next_iteration_starts_before_the_previous_one_ends(monkeypatch):
    # the overlap of a backend whose uploads copy (CUDA): a CPU worker computes on the
    # host weights instead, so a newer version waits until its stage is released
    # (tests/core/test_cpu_lending.py), which is what lets iteration k+1 start early
    from roundpipe_core.running.devices.base import Worker
    from roundpipe_core.running.devices.cpu import CPUWorker

    monkeypatch.setattr(CPUWorker, "lend_in", Worker.lend_in)
    torch.manual_seed(0)
    # layers 0 and 1 are the slow ones: k's backward still has tens of milliseconds to
    # run after worker 0 is free, a margin that scheduling noise on a loaded host does
    # not close (with equal layers it was a few milliseconds, and CI once lost it)
    slow_tail = [_Slow(in_width=8, delay=0.01), _Slow(delay=0.01)]
    model = nn.Sequential(*slow_tail, *[_Slow() for _ in range(3)], nn.Linear(12, 4))
    # separate masters: the asynchronous step lets iteration k+1 start under k's backward
    rp = RoundPipe(
        model,
        devices="cpu:3",
        model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=OVERLAP_PLAN),
        shared_masters=False,
    )
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
    try:
        pending = []
        for x, y in _batches(4, bs=8):
            p = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
            rp.step(lambda: (opt.step(), opt.zero_grad()))
            pending.append(p)
        assert not pending[0].done() or not pending[-1].done()  # the calls returned early
        rp.synchronize()
        assert all(p.done() for p in pending)

        def spans(p, kinds):
            return [(t.start_s, t.end_s) for t in p.timing.jobs if t.job.kind in kinds]

        for p in pending:  # the premise: the round-robin placement described at the plan
            worker = {t.job.index: t.device for t in p.timing.jobs}
            assert worker[0] == worker[3] and len({worker[0], worker[4], worker[5]}) == 3
        for a, b in zip(pending, pending[1:]):
            last = max(t.job.index for t in a.timing.jobs)
            last_end = next(t.end_s for t in a.timing.jobs if t.job.index == last)
            assert next(t.job for t in a.timing.jobs if t.job.index == last).kind == BACKWARD
            first_fwd_start = min(s for s, _ in spans(b, (FORWARD,)))
            assert first_fwd_start < last_end, "iteration k+1 waited for the end of iteration k"
        for a, c in zip(pending, pending[2:]):
            # ... but it computes with the weights of the step after iteration k-1
            assert min(s for s, _ in spans(c, (FORWARD, FUSED, BACKWARD))) >= max(
                e for _, e in spans(a, (FORWARD, FUSED, BACKWARD))
            )
    finally:
        rp.close()


class _Fragile(nn.Module):
    """Fails on a poisoned batch (inputs over 1e3), an ordinary linear layer otherwise."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 12)

    def forward(self, x):
        if bool((x.abs() > 1e3).any()):
            raise FloatingPointError("poisoned batch")
        return self.lin(x)


# multi-stage plans: iteration k+1's stages queue behind k's, so k's failure aborts it
@pytest.mark.usefixtures("concurrent_planning")
@pytest.mark.parametrize("surface", ["result", "next_call"])
def test_a_failed_pipelined_iteration_surfaces_and_the_next_call_works(surface):
    model = mlp()
    model[0] = _Fragile()
    rp = RoundPipe(model, devices="cpu:3", model_run_config=RoundPipeRunConfig(num_microbatch=3))
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
    batches = _batches(4, seed=2)
    batches[1][0][0, 0] = 1e4  # iteration 1 fails in layer 0
    try:
        pending = []
        for x, y in batches[:3]:
            pending.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False))
            rp.step(lambda: (opt.step(), opt.zero_grad()))
        if surface == "result":
            with pytest.raises(FloatingPointError, match="poisoned batch") as info:
                pending[1].result(timeout=30)
            assert "layer 0" in " ".join(getattr(info.value, "__notes__", []))
            with pytest.raises(FloatingPointError):  # aborted by it: reports the cause
                pending[2].result(timeout=30)
        else:
            for p in pending:
                p.wait(timeout=30)
            with pytest.raises(FloatingPointError, match="poisoned batch"):
                rp.step(lambda: opt.step())
        # reported once; the pipeline is drained and usable, blocking or not
        x, y = batches[3]
        p = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        assert torch.isfinite(p.result(timeout=30))
        assert torch.isfinite(rp.forward_backward((x,), label=y, loss_fn=sum_sq))
        rp.synchronize()
        for _, q, m in rp.masters.entries:
            assert torch.equal(q.detach(), m.detach())
            assert torch.isfinite(q).all()
    finally:
        rp.close()


def test_an_async_step_error_before_pipelined_calls_is_not_lost():
    rp = RoundPipe(mlp(), devices="cpu:2", shared_masters=False)
    try:
        x, y = _batches(1)[0]
        rp.forward_backward((x,), label=y, loss_fn=sum_sq)

        def bad():
            raise ArithmeticError("optimizer exploded")

        rp.step(bad, is_async=True)
        p = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
        p.wait(timeout=30)
        with pytest.raises(ArithmeticError, match="optimizer exploded"):
            rp.synchronize()
        assert torch.isfinite(
            rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False).result(timeout=30)
        )
        rp.synchronize()
    finally:
        rp.close()


def test_engine_dispatch_is_the_simulated_overlap_schedule():
    """What the simulator's overlap_iterations times is what pipelined calls run:
    round-robin continues from one iteration to the next."""
    plan = ASYMMETRIC
    iters, devices = 3, 3
    rp = RoundPipe(
        mlp(),
        devices=f"cpu:{devices}",
        model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan),
    )
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.01)
    try:
        pending = []
        for x, y in _batches(iters):
            pending.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False))
            rp.step(lambda: opt.step())
        rp.synchronize()
        ran = [
            sorted((t.job.index, t.job.kind, t.job.layers, t.device) for t in p.timing.jobs)
            for p in pending
        ]
    finally:
        rp.close()
    sim = simulate(
        plan, [1.0] * 6, [2.0] * 6, devices, 3, iterations=iters, overlap_iterations=True
    )
    per_iter = len(sim.jobs) // iters
    expected = [
        sorted(
            (j.index, j.kind, j.layers, j.device)
            for j in sim.jobs[k * per_iter : (k + 1) * per_iter]
        )
        for k in range(iters)
    ]
    assert ran == expected


def test_simulated_upload_waits_for_the_previous_iterations_upload():
    """Iteration 1's first forward (device 1 is free at once) uploads layer 0 only after
    iteration 0's last backward stage (queued behind device 0's other jobs) has read it."""
    plan = ModelExecutePlan(
        [range(0, 1), range(1, 2)],
        [range(2, 3), range(1, 2), range(0, 1)],
        fwd_owners=[1, 0],
        bwd_owners=[0, 0, 0],
    )
    res = simulate(plan, [1.0] * 3, [2.0] * 3, 2, 2, iterations=2, overlap_iterations=True)
    fused0_end = max(e.end for e in res.events if e.iteration == 0 and e.kind == "fused")
    first1 = min(
        e.start for e in res.events if e.iteration == 1 and e.kind == "forward" and e.stage == 0
    )
    fwd0_end = max(
        e.end for e in res.events if e.iteration == 0 and e.kind == "forward" and e.stage == 0
    )
    # device 0 runs F1, X, B1, B0: B0 (layer 0) is prefetched when B1 starts, i.e. when X
    # ends; only then may the host copy of layer 0 change and iteration 1 upload it
    assert first1 > fwd0_end  # device 1 was free at fwd0_end
    assert first1 == pytest.approx(fused0_end)


def test_simulated_optimizer_step_delays_the_iteration_two_later():
    plan = ModelExecutePlan.uniform(8, 8, "fused")
    fast = simulate(plan, [1.0] * 8, [2.0] * 8, 4, 5, iterations=4, overlap_iterations=True)
    slow = simulate(
        plan, [1.0] * 8, [2.0] * 8, 4, 5, iterations=4, overlap_iterations=True, step_ms=60.0
    )
    assert slow.iteration_ms > fast.iteration_ms
    for it in (2, 3):
        prev_end = max(e.end for e in slow.events if e.iteration == it - 2)
        assert min(e.start for e in slow.events if e.iteration == it) >= prev_end + 60.0 - 1e-9
    with pytest.raises(ValueError, match="step_ms"):
        simulate(plan, [1.0] * 8, [2.0] * 8, 4, 5, step_ms=-1.0)


def test_pipelined_calls_feed_the_layer_timer_like_blocking_ones():
    """A pipelined run's per-layer times (kept aside while runs overlap) reach the model
    timer when it is done: the planner sees every layer measured, as after blocking calls."""
    measured = {}
    for blocking in (True, False):
        rp = RoundPipe(
            mlp(), devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=3)
        )
        try:
            for x, y in _batches(3):
                r = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=blocking)
                if not blocking:
                    r.result()
            rp.synchronize()
            t = rp.model_timer
            assert t.measured_iterations() == 2  # the first call is a dropped warm-up
            assert t.has_measurements("fwd") and t.has_measurements("bwd")
            measured[blocking] = (len(t.fwd_ms), all(ms > 0 for ms in t.bwd_ms))
        finally:
            rp.close()
    assert measured[True] == measured[False] == (len(mlp()), True)


def test_a_call_issued_as_a_failure_is_recorded_is_aborted_not_left_waiting(monkeypatch):
    """A step fails between a non-blocking call's check for earlier failures and its
    launch: the failure aborted the calls in flight then, and this one was not among
    them yet. It must stop too -- its uploads wait for the weights of a step that is
    never published -- and raise, not hang (the race is forced here: the check is
    skipped and the failure recorded while a deferred step's publication waits)."""
    import threading

    model = mlp(4)
    (x, y) = (torch.randn(6, 8), torch.randn(6, 4))
    rp = RoundPipe(model, devices="cpu:2", shared_masters=False)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    release = threading.Event()
    try:
        # the optimizer thread is busy: the deferred steps (and the publication of the
        # first step's weights, which a call issued after the second step reads) wait
        rp._steps._submit(release.wait, 30.0)
        issued = []
        for _ in range(2):
            issued.append(rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False))
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        for p in issued:
            p.wait(timeout=60)  # done: the failure below finds no call running
        stepper = rp._steps
        stepper.record_failure(ArithmeticError("step failed meanwhile"))
        monkeypatch.setattr(rp._steps, "raise_failure", lambda: None)
        late = rp.forward_backward((x,), label=y, loss_fn=sum_sq, blocking=False)
        release.set()
        with pytest.raises(ArithmeticError, match="step failed meanwhile"):
            late.result(timeout=30)
    finally:
        release.set()
        monkeypatch.undo()
        try:
            rp.close()
        except ArithmeticError:
            pass
