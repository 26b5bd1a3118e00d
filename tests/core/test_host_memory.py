"""The host-memory budget: each line against the bytes a real run allocates, the optimizer
state table, the readable table and the refusal of a run that cannot fit."""

from __future__ import annotations

import copy
import platform
import sys

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe_core.running.host_memory import (
    HostMemoryBudget,
    HostMemoryError,
    UnknownOptimizerError,
    available_host_memory,
    check_host_memory,
    estimate_host_memory,
    optimizer_states_per_param,
)

W = 32


def _net(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(W, W) for _ in range(4)], nn.LayerNorm(W)).to(dtype)


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    ("opt", "n"),
    [
        ("adamw", 2),
        ("Adam", 2),
        ("sgd", 0),
        (torch.optim.Adagrad, 1),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), 3),
        (lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True), 3),
    ],
)
def test_optimizer_states_per_param(opt: object, n: int) -> None:
    if callable(opt) and not isinstance(opt, type):
        opt = opt([nn.Parameter(torch.zeros(2))])
    assert optimizer_states_per_param(opt) == n


class _SleepySGD(torch.optim.SGD):
    """A user's subclass: it keeps SGD's state."""


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize(
    ("opt", "n"),
    [
        (_SleepySGD, 0),
        (lambda ps: _SleepySGD(ps, lr=0.1, momentum=0.9), 1),
        (lambda ps: _MyAdamW(ps, amsgrad=True), 3),
    ],
)
def test_subclasses_count_their_torch_base_state(opt: object, n: int) -> None:
    if callable(opt) and not isinstance(opt, type):
        opt = opt([nn.Parameter(torch.zeros(2))])
    assert optimizer_states_per_param(opt) == n


def test_optimizer_state_errors_name_the_fix() -> None:
    class Mine(torch.optim.Optimizer):
        pass

    with pytest.raises(UnknownOptimizerError, match="'Mine'.*optimizer_states="):
        optimizer_states_per_param(Mine)
    assert issubclass(UnknownOptimizerError, ValueError)
    with pytest.raises(TypeError, match="got int"):
        optimizer_states_per_param(3)


def test_plain_module_lines_are_exact_and_tied_weights_count_once() -> None:
    net = _net()
    net[1].weight = net[0].weight  # tied: one storage
    n = sum(p.numel() for p in net.parameters())
    b = estimate_host_memory(net, optimizer="adamw", optim_dtype=torch.float32)
    assert b.num_params == n
    assert b.weights == 4 * n and b.masters == 4 * n and b.gradients == 4 * n
    assert b.optimizer_state == 8 * n
    assert b.worker_copies == 0 and b.pinned == 0
    assert b.total == 20 * n and b.bytes_per_param == 20.0
    assert b.already_allocated == b.weights
    bf = estimate_host_memory(_net(torch.bfloat16), optimizer="sgd", optim_dtype=torch.float32)
    assert bf.weights == 2 * bf.num_params and bf.masters == 4 * bf.num_params
    assert bf.optimizer_state == 0


# the worker line of CPU workers, which lend the host's parameters (under
# ROUNDPIPE_TEST_DEVICE the workers stay CPU workers)
@pytest.mark.cpu_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make_opt", ["adamw", "sgd_momentum"])
def test_roundpipe_lines_match_what_a_step_allocates(dtype: torch.dtype, make_opt: str) -> None:
    """Masters, gradients and optimizer state are predicted to the byte; the next
    iteration's gradients of an asynchronous step are one more gradient per separate
    master; CPU workers compute on the host parameters, so their stage copies are only
    the gradients converted to the masters' dtype (none for fp32: they become ``.grad``)."""
    rp = RoundPipe(_net(dtype), optim_dtype=torch.float32, devices="cpu:2", shared_masters=False)
    try:
        with OptimizerCtx():
            if make_opt == "adamw":
                opt: torch.optim.Optimizer = torch.optim.AdamW(rp.parameters(), lr=1e-3)
            else:
                opt = torch.optim.SGD(rp.parameters(), lr=1e-3, momentum=0.9)
        b = estimate_host_memory(rp, optimizer=opt, num_microbatch=3)
        net = rp.model
        assert b.weights == _bytes(list(net.parameters()) + list(net.buffers()))
        masters = rp.optim_parameters()
        assert b.masters == _bytes(masters)
        assert b.already_allocated == b.weights + b.masters
        x, y = torch.randn(6, W).to(dtype), torch.randn(6, W).to(dtype)
        rp.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda o, t: ((o.float() - t.float()) ** 2).mean()
        )
        rp.synchronize()
        assert b.gradients == _bytes([m.grad for m in masters])
        rp.step(opt.step, is_async=False)
        state = [
            t for s in opt.state.values() for k, t in s.items() if k != "step" and t.numel() > 1
        ]
        assert b.optimizer_state == _bytes(state)
        assert b.next_gradients == _bytes(masters)  # separate masters: the step may overlap
        assert estimate_host_memory(rp, optimizer=opt, async_step=False).next_gradients == 0
        params = list(net.parameters())
        # the one stage runs as one job per worker once seen not to draw (the default
        # ROUNDPIPE_CPU_CONCURRENT): the second replica holds gradients of its own
        replicas = 2 if rp.pool.cpu_overlap else 1
        extra = (replicas - 1) * _bytes(params)
        if dtype == torch.float32:
            # no buffers; the first replica's gradients are the masters'
            assert b.worker_copies == extra
        else:  # bf16 gradients held until the stage ends, beside their fp32 conversion
            assert extra < b.worker_copies <= _bytes(params) + extra
    finally:
        rp.close()


@pytest.mark.cpu_backend
def test_replicas_hold_the_gradients_the_budget_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-stage plan run as one job per CPU worker keeps each replica's gradients
    until the last is in (``replicas.JobGrads``): the budget's worker line counts the
    replicas after the first -- measured: the gradient bytes each replica job hands in."""
    from roundpipe_core.running import replicas as replicas_mod

    handed: list[tuple[int, int]] = []  # (replica, gradient bytes) per replicated job
    real = replicas_mod.download_grads

    def counting(stage, sink_many):  # type: ignore[no-untyped-def]
        got: list[torch.Tensor] = []

        def keep(ps: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
            got.extend(gs)
            sink_many(ps, gs)

        real(stage, keep)
        handed.append((current[0], _bytes(got)))

    current = [0]
    download = replicas_mod.JobGrads.download

    def tracking(self, job, stage):  # type: ignore[no-untyped-def]
        current[0] = job.replica
        return download(self, job, stage)

    rp = RoundPipe(_net(), devices="cpu:2")
    try:
        if not rp.pool.cpu_overlap:
            pytest.skip("ROUNDPIPE_CPU_CONCURRENT=0: CPU workers never compute side by side")
        with OptimizerCtx():
            opt = torch.optim.SGD(rp.optim_parameters(), lr=1e-3)
        b = estimate_host_memory(rp, optimizer=opt, num_microbatch=4)
        monkeypatch.setattr(replicas_mod, "download_grads", counting)
        monkeypatch.setattr(replicas_mod.JobGrads, "download", tracking)
        x, y = torch.randn(8, W), torch.randn(8, W)
        for _ in range(4):  # the stage shares the cores once seen not to draw
            handed.clear()
            rp.forward_backward(
                input_args=(x,),
                label=y,
                loss_fn=lambda o, t: ((o - t) ** 2).mean(),
                run_config=RoundPipeRunConfig(num_microbatch=4),
            )
            rp.synchronize()
            rp.step(lambda: (opt.step(), opt.zero_grad(set_to_none=True)), is_async=False)
        assert sorted(r for r, _ in handed) == [0, 1]  # the last call ran two replicas
        later = sum(n for r, n in handed if r > 0)
        assert later == _bytes(list(rp.model.parameters()))
        assert b.worker_copies == later
    finally:
        rp.close()


def test_worker_copies_follow_the_plan() -> None:
    """Per worker: the largest (stage + its gradients on backward + the prefetched next
    stage) over its jobs; summed over workers (workers that copy every tensor, as a
    device with its own memory does)."""
    rp = RoundPipe(_net(), devices="cpu:2")
    for w in rp.pool.workers:
        w.lends_host_tensors = False
    try:
        layer = [_bytes(list(m.parameters())) for m in rp.layers]
        one_stage = ModelExecutePlan()
        one_stage.fwd_plan, one_stage.bwd_plan = [], [range(0, 5)]
        b = estimate_host_memory(rp, plan=one_stage, num_microbatch=2)
        # a fused job on each worker (the stage's replicas, where the CPU workers compute
        # side by side), else on worker 0 alone: weights + their gradients
        assert b.worker_copies == (2 if rp.pool.cpu_overlap else 1) * 2 * sum(layer)
        per_layer = ModelExecutePlan.uniform(5, 5, "fused")
        b2 = estimate_host_memory(rp, plan=per_layer, num_microbatch=2)
        assert 0 < b2.worker_copies < b.worker_copies
    finally:
        rp.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_process_line_is_the_resident_set_beyond_the_state() -> None:
    """``process`` = the resident set at the estimate minus the state already allocated;
    ``process_peak`` adds it to the state lines (the whole process's peak)."""
    from roundpipe_core.running.host_memory import resident_bytes

    rp = RoundPipe(_net(), devices="cpu:2", shared_masters=False)
    try:
        before = resident_bytes()
        b = estimate_host_memory(rp, num_microbatch=3)
        after = resident_bytes()
        assert before - b.already_allocated - 2**20 <= b.process
        assert b.process <= after - b.already_allocated + 2**20
        assert b.process > 50 * 2**20  # an interpreter with torch loaded
        assert b.process_peak == b.total + b.process + b.training_code
        assert "= whole process" in str(b)
    finally:
        rp.close()


_CODE_PROBE = """
import torch
from torch import nn
from roundpipe_core import RoundPipe
from roundpipe_core.running.host_memory import estimate_host_memory
from roundpipe_core.running.host_memory import TRAINING_CODE_BYTES

def file_pages():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssFile:"))

net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))] * 2)
rp = RoundPipe(net, devices="cpu:2")
opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)
first = estimate_host_memory(rp, optimizer=opt)
before = file_pages()
for _ in range(2):
    rp.forward_backward(input_args=(torch.randn(6, 64),), label=torch.randn(6, 64),
                        loss_fn=lambda o, t: ((o - t) ** 2).mean())
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
rp.synchronize()
later = estimate_host_memory(rp, optimizer=opt)
print(first.training_code == TRAINING_CODE_BYTES, later.training_code,
      "+ training code (first step)" in str(first), file_pages() - before, TRAINING_CODE_BYTES)
rp.close()
"""


@pytest.mark.host_only  # all in child processes
@pytest.mark.cpu_backend
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_training_code_line_is_what_the_first_step_pages_in() -> None:
    """A budget made before the process's first step adds the torch code that step pages
    in (file-backed pages of libtorch: measured here, in a fresh process, as the growth
    of ``RssFile`` over two steps -- at most the allowance and not far below it); one
    made after a step has it in its ``process`` line already."""
    import os
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _CODE_PROBE],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    first_ok, later, printed, grew, allowance = out.stdout.split()
    assert (first_ok, later, printed) == ("True", "0", "True")
    assert int(allowance) // 4 < int(grew) <= int(allowance)


_HEAP_PROBE = """
import torch
from roundpipe_core.running.host_memory import limit_heap_retention, resident_bytes
print(limit_heap_retention())
big = torch.ones(5 * 2**20)  # 20 MiB: freeing it raises glibc's dynamic mmap threshold
del big
t = torch.ones(4 * 2**20)  # 16 MiB, touched
held = resident_bytes()
del t
print((held - resident_bytes()) // 2**20)
"""


@pytest.mark.host_only  # all in child processes
@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="tunes glibc malloc (limit_heap_retention)"
)
def test_limit_heap_retention_returns_freed_tensors_to_the_system() -> None:
    """With the threshold fixed, a freed 16 MiB tensor leaves the resident set even after
    a larger one was freed (which, by default, makes glibc keep such tensors)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    applied, released = out.stdout.split()
    assert applied == "True"
    assert int(released) >= 15, f"only {released} MiB of a freed 16 MiB tensor left the process"


@pytest.mark.cpu_backend
def test_lending_workers_hold_buffers_only() -> None:
    """CPU workers lend the host's parameters: a stage's copies are its buffers (BatchNorm
    statistics), per worker the largest stage's plus the prefetched next one's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(W, W), nn.BatchNorm1d(W), nn.Linear(W, W), nn.BatchNorm1d(W))
    rp = RoundPipe(net, devices="cpu:2")
    try:
        one_stage = ModelExecutePlan()
        one_stage.fwd_plan, one_stage.bwd_plan = [], [range(0, 4)]
        b = estimate_host_memory(rp, plan=one_stage, num_microbatch=2)
        assert b.worker_copies == _bytes(list(net.buffers()))
        assert b.next_gradients == 0  # fp32 on CPU workers: shared masters, a synchronous step
    finally:
        rp.close()


def test_next_gradients_line_only_for_separate_masters() -> None:
    shared = RoundPipe(_net(), devices="cpu:2", shared_masters=True)
    separate = RoundPipe(_net(), devices="cpu:2", shared_masters=False)
    try:
        assert estimate_host_memory(shared).next_gradients == 0
        assert estimate_host_memory(shared, async_step=True).next_gradients == 0
        n = _bytes(separate.optim_parameters())
        b = estimate_host_memory(separate)
        assert (
            b.next_gradients == n
            and b.total == estimate_host_memory(separate, async_step=False).total + n
        )
        assert "next gradients (async step)" in str(b)
        # a plain module: only when asked
        plain = estimate_host_memory(_net(), async_step=True)
        assert plain.next_gradients == plain.masters > 0
        assert (
            estimate_host_memory(_net(), async_step=True, shared_masters=True).next_gradients == 0
        )
        assert estimate_host_memory(_net()).next_gradients == 0
        with pytest.raises(TypeError, match="async_step"):
            estimate_host_memory(separate, async_step=1)  # type: ignore[arg-type]
    finally:
        shared.close()
        separate.close()


def test_activation_line() -> None:
    rp = RoundPipe(_net(), devices="cpu:2")
    try:
        plan = rp.default_plan("fused", 3)
        b = estimate_host_memory(rp, num_microbatch=3, activation_bytes_per_microbatch=1000)
        assert b.activations == 1000 * 3 * max(len(plan.fwd_plan), 1)
        with pytest.raises(ValueError, match="activation_bytes_per_microbatch"):
            estimate_host_memory(rp, activation_bytes_per_microbatch=-1)
        with pytest.raises(TypeError, match="Optimizer instances"):
            estimate_host_memory(rp, optimizer=["adamw"])
    finally:
        rp.close()


def test_table_is_readable() -> None:
    b = estimate_host_memory(_net(), optimizer="adamw", optim_dtype=torch.float32)
    text = str(b)
    for row in ("weights", "masters", "gradients", "optimizer state (adamw: 2/param)", "total"):
        assert row in text
    assert "20.00 B/param" in text
    assert f"{b.num_params:,} parameters" in text


def _budget(total_gib: float, allocated_gib: float = 0.0) -> HostMemoryBudget:
    g = int(total_gib * 1024**3)
    return HostMemoryBudget(
        num_params=g // 20,
        weights=g // 5,
        masters=g // 5,
        gradients=g // 5,
        optimizer_state=g - 3 * (g // 5),
        pinned=0,
        worker_copies=0,
        activations=0,
        already_allocated=int(allocated_gib * 1024**3),
        optimizer="adamw: 2/param",
    )


def test_check_refuses_with_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROUNDPIPE_SKIP_MEMORY_CHECK", raising=False)
    with pytest.raises(HostMemoryError, match=r"needs 9 GiB more.*only 8 GiB is available") as info:
        check_host_memory(_budget(10, allocated_gib=1), available=8 * 1024**3)
    assert isinstance(info.value, ValueError) and isinstance(info.value, MemoryError)
    assert "optimizer state" in str(info.value)  # the table comes with it
    check_host_memory(_budget(10, allocated_gib=3), available=8 * 1024**3, headroom=0.0)
    # 5% headroom: 7.6 GiB usable
    with pytest.raises(HostMemoryError):
        check_host_memory(_budget(10, allocated_gib=2.2), available=8 * 1024**3)
    monkeypatch.setenv("ROUNDPIPE_SKIP_MEMORY_CHECK", "1")
    check_host_memory(_budget(100), available=1)
    with pytest.raises(ValueError, match="headroom"):
        check_host_memory(_budget(1), available=1, headroom=1.5)


def test_available_host_memory_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    avail = available_host_memory()
    if avail is None:
        pytest.skip("no memory information on this platform")
    assert avail > 0
    monkeypatch.setitem(sys.modules, "psutil", None)  # import fails: /proc/meminfo
    fallback = available_host_memory()
    assert fallback is not None and fallback > 0
    assert abs(fallback - avail) < max(avail, fallback) * 0.5


def test_state_shards_divide_the_optimizer_state_and_the_separate_masters() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3))
    whole = estimate_host_memory(model, optimizer="adamw")
    quarter = estimate_host_memory(model, optimizer="adamw", state_shards=4)
    assert quarter.optimizer_state == -(-whole.optimizer_state // 4)
    assert whole.masters > 0 and quarter.masters == -(-whole.masters // 4)
    assert (quarter.weights, quarter.gradients) == (whole.weights, whole.gradients)
    # a parameter that is its own master has no master bytes to shard
    shared = estimate_host_memory(model, optimizer="adamw", shared_masters=True, state_shards=4)
    assert shared.masters == 0
    # a built RoundPipe's separate masters (a bf16 model, fp32 masters): 1/N of them
    rp = RoundPipe(
        copy.deepcopy(model).to(torch.bfloat16), optim_dtype=torch.float32, devices="cpu:1"
    )
    try:
        full = estimate_host_memory(rp, optimizer="adamw")
        half = estimate_host_memory(rp, optimizer="adamw", state_shards=2)
        assert full.masters == sum(m.numel() * 4 for m in rp.optim_parameters())
        assert half.masters == -(-full.masters // 2)
    finally:
        rp.close()
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="state_shards"):
            estimate_host_memory(model, state_shards=bad)  # type: ignore[arg-type]


def test_an_async_sharded_step_shards_the_masters_too() -> None:
    """``DataParallel.attach(..., async_step=True)`` releases the masters other ranks own
    as the synchronous attach does (their owners publish them into the model): the masters
    line is 1/N, and so are the optimizer state and the next-gradients line (the next
    backward's gradients arrive while the step in flight reads this rank's share of the
    last ones; the gradients line, whole, counts the next ones). A sharded run's default
    (``async_step=None``) is synchronous: no next-gradients line."""
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3))
    whole = estimate_host_memory(model, optimizer="adamw", async_step=True)
    quarter = estimate_host_memory(model, optimizer="adamw", state_shards=4, async_step=True)
    assert quarter.masters == -(-whole.masters // 4) and whole.masters > 0
    assert whole.next_gradients == whole.masters
    assert quarter.next_gradients == quarter.masters
    assert quarter.optimizer_state == -(-whole.optimizer_state // 4)
    rp = RoundPipe(
        copy.deepcopy(model).to(torch.bfloat16), optim_dtype=torch.float32, devices="cpu:1"
    )
    try:
        all_masters = sum(m.numel() * 4 for m in rp.optim_parameters())
        half = estimate_host_memory(rp, optimizer="adamw", state_shards=2, async_step=True)
        assert half.masters == half.next_gradients == -(-all_masters // 2)
        default = estimate_host_memory(rp, optimizer="adamw", state_shards=2)
        assert default.masters == -(-all_masters // 2) and default.next_gradients == 0
        assert estimate_host_memory(rp, optimizer="adamw").next_gradients == all_masters
    finally:
        rp.close()


def test_sharding_says_once_how_to_get_the_budgets_peak(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import roundpipe_core.distributed.data_parallel as dp_module
    import roundpipe_core.running.host_memory as host_memory
    from roundpipe_core.distributed import DataParallel

    monkeypatch.delenv(host_memory.HEAP_THRESHOLD_ENV, raising=False)
    monkeypatch.setattr(host_memory, "_applied", None)
    dp_module._say_heap_once.cache_clear()  # (said once per process)
    with caplog.at_level(logging.INFO, logger=dp_module.__name__):
        DataParallel(shard_host_state=True)
        DataParallel(shard_host_state=True)
    said = [r for r in caplog.records if "MALLOC_MMAP_THRESHOLD_=65536" in r.getMessage()]
    assert len(said) == 1
    caplog.clear()
    dp_module._say_heap_once.cache_clear()  # (said once per process)
    monkeypatch.setenv(host_memory.HEAP_THRESHOLD_ENV, "65536")  # the launch chose: nothing to say
    with caplog.at_level(logging.INFO, logger=dp_module.__name__):
        DataParallel(shard_host_state=True)
    assert host_memory.heap_retention_limited() and not caplog.records


def test_summary_is_one_line_of_need_against_available() -> None:
    """The line a set-up says (the whole table is ``str(budget)``)."""
    budget = HostMemoryBudget(
        num_params=10,
        weights=40,
        masters=0,
        gradients=40,
        optimizer_state=80,
        pinned=0,
        worker_copies=0,
        activations=0,
        already_allocated=40,
        process=2**20,
    )
    line = budget.summary(2**30)
    assert "\n" not in line
    assert line == (
        "host memory: needs 1 MiB for the whole process (120 B still to allocate), 1 GiB available"
    )
    assert budget.summary(None).endswith("available unknown")
    assert len(str(budget).splitlines()) > 10  # the table, on request
