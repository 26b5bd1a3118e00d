"""Deferred downloads on fake CUDA: a stage's outputs and input gradients are not waited
for inside every microbatch; whoever reads them orders its read after the download
(another worker's upload waits on the download's event, the host completes them), the
device sources stay alive until the download ran, and the results are plain PyTorch's.

These run on a machine without a GPU (the fake is refused where one is visible).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe_core.running.devices import downloads, memory

pytestmark = pytest.mark.skipif(
    memory.cuda_available(), reason="fake CUDA is for machines without a GPU"
)


def _sum_sq(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).sum()


def _three_stage_plan() -> ModelExecutePlan:
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(2, 4)]
    plan.bwd_plan = [range(4, 6), range(2, 4), range(0, 2)]
    return plan


class _TwoOfAKind:
    """What ``get_device_properties`` reports for each of the two fake GPUs (one model)."""

    name, multi_processor_count, total_memory = "fake GPU", 108, 16 << 30


@pytest.fixture
def two_fake_gpus(fake_cuda: type, monkeypatch: pytest.MonkeyPatch) -> type:
    """Two fake GPUs, and a staging ring that holds a call's activations (the fake's
    default of 512 bytes would make every few downloads wait for ring memory)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: _TwoOfAKind())
    monkeypatch.setattr(fake_cuda, "fake_download_staging_bytes", 64 * 1024)
    return fake_cuda


def test_a_three_stage_call_waits_a_fixed_number_of_times_per_stage(
    two_fake_gpus: type, host_syncs: Any
) -> None:
    """Five jobs (two forward stages, the fused stage, two backward stages) on two GPUs:
    the host waits per job (its gradients) and per queue, never per microbatch. With
    ``copy_out`` waiting for every activation and input gradient (the old code) the
    count grows by four per microbatch. Losses and gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    ref = copy.deepcopy(model)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    rp = RoundPipe(model, devices=["cuda:0", "cuda:1"], pin_model="off")
    syncs, losses, grads = {}, {}, {}
    try:
        rp.layer_activation_bytes = [0.0] * 6  # no measuring forward in the count
        for m in (2, 8, 2, 8):
            cfg = RoundPipeRunConfig(num_microbatch=m, execute_plan=_three_stage_plan())
            before = host_syncs()
            losses[m] = rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
            syncs[m] = host_syncs() - before
            grads[m] = [p.grad.clone() for p in rp.optim_parameters()]
            for p in rp.optim_parameters():
                p.grad = None
    finally:
        rp.close()
    jobs = 5
    # two per job at most, whatever the microbatches (3 in all here, at 2 and at 8;
    # waiting per download, 11 and 35); fewer where the fake's copies ran by themselves
    assert max(syncs.values()) <= 2 * jobs, syncs
    loss = _sum_sq(ref(x), y)
    loss.backward()
    for m in (2, 8):
        torch.testing.assert_close(losses[m], loss.detach(), rtol=1e-5, atol=1e-5)
        for g, p in zip(grads[m], ref.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5)
    assert not downloads.has_pending(), "a call left downloads unfinished"


def test_forward_outputs_are_complete_when_the_call_returns(two_fake_gpus: type) -> None:
    """Three forward stages on two GPUs: the last stage's outputs are deferred downloads,
    finished before ``forward()`` returns (a missing wait would return NaN)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    x = torch.randn(12, 8)
    rp = RoundPipe(model, devices=["cuda:0", "cuda:1"], pin_model="off")
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(2, 4), range(4, 6)]
    try:
        rp.layer_activation_bytes = [0.0] * 6
        cfg = RoundPipeRunConfig(num_microbatch=4, execute_plan=plan, requires_grad=False)
        with torch.no_grad():
            out = rp(x, roundpipe_run_config=cfg)
            ref = model(x)
    finally:
        rp.close()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.fixture
def make_worker(two_fake_gpus: type):
    made: list[Any] = []

    def make(gpu: int = 0, **kwargs: Any) -> Any:
        w = two_fake_gpus(len(made), torch.device("cuda", gpu), **kwargs)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def _on(worker: Any, fn: Any) -> Any:
    return worker.submit(fn).result(timeout=30)


def test_an_upload_on_another_gpu_reads_a_pending_download_in_stream_order(
    make_worker: Any, host_syncs: Any
) -> None:
    """Worker 1 uploads what worker 0 downloaded, before anyone finished the download:
    its stream waits on the download's event and copies from the pinned piece; no host
    wait on either worker, and the data is right."""
    producer, consumer = make_worker(0), make_worker(1)
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)

    def produce() -> torch.Tensor:
        dev = producer.copy_in([src], "activation")
        producer.wait_channel("activation")
        return producer.copy_out_deferred([dev[0] * 2])[0]

    before = host_syncs()
    host = _on(producer, produce)
    assert downloads.has_pending()

    def consume() -> torch.Tensor:
        dev = consumer.copy_in([host], "activation")
        consumer.wait_channel("activation")
        return dev[0].clone()

    got = _on(consumer, consume)
    assert host_syncs() == before, "a worker waited on the host"
    torch.testing.assert_close(got, src * 2)
    _on(producer, producer.finish_lazy_downloads)
    assert not downloads.has_pending()
    torch.testing.assert_close(host, src * 2)  # and the host copy is filled too


def test_an_upload_of_another_view_of_a_pending_download_gets_it_completed(
    make_worker: Any,
) -> None:
    """A slice of a pending host tensor is not the tensor the download registered: the
    upload completes the download on the host before copying (else: the fake's NaN)."""
    producer, consumer = make_worker(0), make_worker(1)
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)

    def produce() -> torch.Tensor:
        dev = producer.copy_in([src], "activation")
        producer.wait_channel("activation")
        return producer.copy_out_deferred([dev[0] - 1])[0]

    host = _on(producer, produce)

    def consume() -> torch.Tensor:
        dev = consumer.copy_in([host[1:]], "activation")
        consumer.wait_channel("activation")
        return dev[0].clone()

    torch.testing.assert_close(_on(consumer, consume), src[1:] - 1)
    assert not downloads.has_pending()


def test_the_staging_ring_is_not_reused_under_an_upload_still_reading_it(
    make_worker: Any,
) -> None:
    """Worker 1's upload copies from worker 0's pinned piece and has not run yet when
    worker 0's next download needs that ring memory: the download waits for the upload
    first (else the upload would read the next download's bytes)."""
    producer = make_worker(0, download_staging_bytes=256)  # one 64-float piece fills it
    consumer = make_worker(1)
    first, second = torch.arange(64, dtype=torch.float32), -torch.arange(64.0)

    def produce() -> torch.Tensor:
        dev = producer.copy_in([first], "activation")
        producer.wait_channel("activation")
        return producer.copy_out_deferred([dev[0] + 0])[0]

    host = _on(producer, produce)
    dev = _on(consumer, lambda: consumer.copy_in([host], "activation"))  # not waited for
    again = _on(producer, lambda: producer.copy_out([second]))  # reuses the whole ring
    _on(consumer, lambda: consumer.wait_channel("activation"))
    torch.testing.assert_close(dev[0], first)
    torch.testing.assert_close(again[0], second)
    torch.testing.assert_close(host, first)


def test_the_host_completes_a_pending_download_before_reading_it(make_worker: Any) -> None:
    """``complete_pending`` (what a worker that reads host memory directly gets) fills
    the host tensor; before it, the tensor holds the fake's fill pattern (NaN)."""
    producer = make_worker(0)
    src = torch.arange(10, dtype=torch.float32)

    def produce() -> torch.Tensor:
        dev = producer.copy_in([src], "activation")
        producer.wait_channel("activation")
        return producer.copy_out_deferred([dev[0] + 1])[0]

    host = _on(producer, produce)
    assert torch.isnan(host).all()
    downloads.complete_pending([host])
    torch.testing.assert_close(host, src + 1)
    assert not downloads.has_pending()


def test_a_deferred_download_larger_than_the_ring_leaves_nothing_pending(
    make_worker: Any,
) -> None:
    """Pieces of one download retire each other in a small ring; every piece is finished
    by the end of the queue and nothing stays registered as pending."""
    worker = make_worker(0, download_staging_bytes=128)
    srcs = [torch.arange(100, dtype=torch.float32), torch.tensor(7.0), torch.arange(40)]

    def job() -> list[torch.Tensor]:
        dev = worker.copy_in(srcs, "activation")
        worker.wait_channel("activation")
        outs = worker.copy_out_deferred(dev)
        worker.finish_lazy_downloads()
        return outs

    outs = _on(worker, job)
    assert not downloads.has_pending()
    for o, s in zip(outs, srcs):
        assert torch.equal(o, s)


def test_closing_a_worker_finishes_the_downloads_nobody_read(make_worker: Any) -> None:
    worker = make_worker(0)

    def produce() -> torch.Tensor:
        dev = worker.copy_in([torch.ones(5)], "activation")
        worker.wait_channel("activation")
        return worker.copy_out_deferred([dev[0] * 4])[0]

    host = _on(worker, produce)
    assert downloads.has_pending()
    worker.close()
    assert not downloads.has_pending() and worker.drained
    torch.testing.assert_close(host, torch.full((5,), 4.0))


def test_a_download_whose_device_source_is_freed_before_it_ran_is_caught(
    make_worker: Any, take_source_races: Any
) -> None:
    """The fake holds a download's device source only weakly: one dropped before the
    download ran is a race (on a GPU the memory could be handed out again)."""
    worker = make_worker(0)

    def job() -> None:
        src = torch.ones(8)
        dst = torch.empty(8)
        worker._copy_on(worker.download_stream, [(dst, src)])
        del src
        event = torch.cuda.Event()
        event.record(worker.download_stream)
        event.synchronize()

    _on(worker, job)
    races = take_source_races()
    assert races and "freed" in races[0], races


def test_a_deferred_download_keeps_its_device_source(make_worker: Any) -> None:
    """The worker keeps what it downloads referenced until the download is finished: the
    caller may drop its device tensor right after ``copy_out_deferred`` (the fake's
    race check above stays quiet, and the data arrives)."""
    worker = make_worker(0)

    def job() -> torch.Tensor:
        dev = worker.copy_in([torch.arange(16, dtype=torch.float32)], "activation")
        worker.wait_channel("activation")
        out = worker.copy_out_deferred([dev[0] * 3])[0]  # the product: held by no one else
        del dev
        worker.finish_lazy_downloads()
        return out

    torch.testing.assert_close(_on(worker, job), torch.arange(16, dtype=torch.float32) * 3)


def test_a_failed_deferred_download_reaches_the_caller_and_the_ring_goes_on(
    make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait on a deferred download that raises (a failed copy) is raised where the
    download is finished (here the end of the queue); the piece is retired anyway, and
    the next download through the same ring arrives."""
    worker = make_worker(0)
    src = torch.arange(6, dtype=torch.float32)

    def produce() -> torch.Tensor:
        dev = worker.copy_in([src], "activation")
        worker.wait_channel("activation")
        return worker.copy_out_deferred([dev[0]])[0]

    _on(worker, produce)
    piece = worker._downloads._slots[-1]

    def failing_wait() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(piece.event, "query", lambda: False)
    monkeypatch.setattr(piece.event, "synchronize", failing_wait)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _on(worker, worker.finish_lazy_downloads)
    assert piece.finished and not downloads.has_pending()
    again = _on(worker, lambda: worker.copy_out([src + 1]))
    torch.testing.assert_close(again[0], src + 1)


def test_the_host_memory_budget_counts_each_workers_download_rings(
    two_fake_gpus: type, fake_pinned: Any
) -> None:
    """The pinned line of the budget is what the workers' rings page-lock after a call
    (the staging ring is allocated whole at the first download), whatever the model.
    (The budget's own test for a CUDA pool reads ``pool.is_cuda``, which the fake's
    workers, whose device is the CPU, do not set: its CUDA line is called directly.)"""
    from roundpipe_core.running.host_memory import _cuda_pinned

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    rp = RoundPipe(model, devices=["cuda:0", "cuda:1"], pin_model="off")
    try:
        rp.layer_activation_bytes = [0.0] * 4
        pinned = _cuda_pinned(rp)
        assert pinned == 2 * (64 * 1024 + 1024)  # two workers: staging ring + loss ring
        before = fake_pinned.reserved
        cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=_two_stage_plan())
        rp.forward_backward(
            (torch.randn(4, 8),), label=torch.randn(4, 8), loss_fn=_sum_sq, run_config=cfg
        )
        assert fake_pinned.reserved - before <= pinned
    finally:
        rp.close()


def _two_stage_plan() -> ModelExecutePlan:
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [range(0, 2)], [range(2, 4), range(0, 2)]
    return plan


def test_a_failed_queue_raises_its_own_error_not_the_downloads() -> None:
    """A queue that failed still finishes its deferred downloads; if that fails as well
    (a broken device fails every wait), the caller sees the queue's error."""
    from roundpipe_core.running.devices.pool import _run_then_finish

    finished: list[bool] = []

    class Worker:
        def finish_lazy_downloads(self) -> None:
            finished.append(True)
            raise RuntimeError("CUDA error: the download failed too")

    def failing_queue(worker: Any, queue: list[Any]) -> None:
        raise ValueError("the layer failed")

    with pytest.raises(ValueError, match="the layer failed"):
        _run_then_finish(failing_queue, Worker(), [])  # type: ignore[arg-type]
    assert finished == [True]
    with pytest.raises(RuntimeError, match="download failed"):  # a queue that went well
        _run_then_finish(lambda w, q: None, Worker(), [])  # type: ignore[arg-type]


def test_a_failed_deferred_download_reaches_the_caller_and_the_next_call_works(
    two_fake_gpus: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first wait on a deferred download fails (as a failed copy's would): the call
    raises that error; the next call's losses and gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    original = downloads.DownloadStager._register
    failures = [RuntimeError("CUDA error: unspecified launch failure")]
    wrapped: list[bool] = []

    def register_failing_once(self: Any, parts: list[Any], outs: list[Any]) -> None:
        """The first deferred download's event fails the first query or wait on it."""
        if not wrapped:
            wrapped.append(True)
            event = parts[-1].event
            query, synchronize = event.query, event.synchronize

            def fail_once(then: Any) -> Any:
                def check() -> Any:
                    if failures:
                        raise failures.pop()
                    return then()

                return check

            event.query, event.synchronize = fail_once(query), fail_once(synchronize)
        original(self, parts, outs)

    rp = RoundPipe(model, devices=["cuda:0", "cuda:1"], pin_model="off")
    try:
        rp.layer_activation_bytes = [0.0] * 6
        cfg = RoundPipeRunConfig(num_microbatch=4, execute_plan=_three_stage_plan())
        monkeypatch.setattr(downloads.DownloadStager, "_register", register_failing_once)
        with pytest.raises(RuntimeError, match="unspecified launch failure"):
            rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
        assert not failures, "no deferred download was waited for"
        monkeypatch.setattr(downloads.DownloadStager, "_register", original)
        for p in rp.optim_parameters():
            assert p.grad is None  # a failed call leaves .grad as it was
        loss = rp.forward_backward((x,), label=y, loss_fn=_sum_sq, run_config=cfg)
        grads = [p.grad for p in rp.optim_parameters()]
    finally:
        rp.close()
    expected = _sum_sq(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5)


@dataclasses.dataclass
class _Output:
    """A last-stage output whose construction reads its tensors (as a Hugging Face
    ``ModelOutput``'s ``__post_init__`` computes the loss from per-sample sums)."""

    values: torch.Tensor
    total: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.values, torch.Tensor):  # not when packed per microbatch
            self.total = self.values.sum()


class _ToOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(x)


def test_an_output_whose_rebuild_reads_its_tensors_sees_them_downloaded(
    two_fake_gpus: type, host_syncs: Any
) -> None:
    """Rebuilding the fused stage's dataclass output on the host runs its
    ``__post_init__``: it is built after the run, when its downloads are complete (else
    ``total`` is the fake's NaN), so the stage still waits no more with six microbatches
    than with three; the returned outputs are plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), _ToOutput())
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    with torch.no_grad():
        ref = model(x).values
    rp = RoundPipe(model, devices=["cuda:0", "cuda:1"], pin_model="off")
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [range(0, 2)], [range(2, 4), range(0, 2)]
    syncs = {}
    try:
        rp.layer_activation_bytes = [0.0] * 4
        for m in (3, 6):
            cfg = RoundPipeRunConfig(num_microbatch=m, execute_plan=plan, merge_output=False)
            before = host_syncs()
            _, out = rp.forward_backward(
                (x,),
                label=y,
                loss_fn=lambda o, t: _sum_sq(o.values, t),
                return_outputs=True,
                run_config=cfg,
            )
            syncs[m] = host_syncs() - before
            # merge_output=False: each field packs the microbatches' values as built
            assert len(out.values) == len(out.total) == m
            for values, total, rows in zip(out.values, out.total, ref.split(6 // m)):
                torch.testing.assert_close(values, rows, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(total, rows.sum(), rtol=1e-5, atol=1e-5)
    finally:
        rp.close()
    assert max(syncs.values()) <= 2 * 3, syncs  # three jobs
