"""CUDA backend and host-memory helpers.

The first part runs everywhere: it tests the logic of ``devices/cuda.py`` and
``devices/memory.py`` that needs no GPU (CUDA detection, errors, chunk
planning, the parameter feeder with fake events, slab packing, pin modes as
no-ops). The second part (marked ``cuda``) drives a real
``CUDAWorker`` and is skipped without a GPU.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from roundpipe_core.running.devices import cuda as cuda_mod
from roundpipe_core.running.devices import memory
from roundpipe_core.running.devices.cuda import CUDAWorker
from roundpipe_core.running.devices.feeder import ChunkFeeder, plan_chunks


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like a machine without CUDA, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# ---------------------------------------------------------------------------
# detection and errors
# ---------------------------------------------------------------------------
def test_module_imports_and_finds_no_cuda_without_it(no_cuda: None) -> None:
    assert memory.cuda_available() is False


def test_cuda_check_survives_a_broken_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    assert memory.cuda_available() is False


def test_worker_without_cuda_is_a_clear_value_error(no_cuda: None) -> None:
    with pytest.raises(ValueError, match="CUDA is not available.*cpu:N"):
        CUDAWorker(0, torch.device("cuda", 0))


def test_worker_rejects_cpu_device() -> None:
    with pytest.raises(ValueError, match="needs a cuda device"):
        CUDAWorker(0, torch.device("cpu"))


def test_worker_rejects_missing_gpu_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="2 GPU\\(s\\) are visible"):
        CUDAWorker(0, torch.device("cuda", 5))


def test_env_overrides_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUNDPIPE_PARAM_CHUNK_MB", "lots")
    with pytest.raises(ValueError, match="ROUNDPIPE_PARAM_CHUNK_MB"):
        cuda_mod._setting("param_chunk_bytes", None)
    monkeypatch.setenv("ROUNDPIPE_PARAM_CHUNK_MB", "8")
    assert cuda_mod._setting("param_chunk_bytes", None) == 8 * 2**20
    assert cuda_mod._setting("param_chunk_bytes", 5) == 5  # the argument wins
    monkeypatch.setenv("ROUNDPIPE_PARAM_INFLIGHT", "-1")
    with pytest.raises(ValueError, match="param_inflight_chunks .* must be >= 0"):
        cuda_mod._setting("param_inflight_chunks", None)
    monkeypatch.delenv("ROUNDPIPE_PARAM_CHUNK_MB")
    assert cuda_mod._setting("param_chunk_bytes", None) == 32 * 2**20


# ---------------------------------------------------------------------------
# chunk planning
# ---------------------------------------------------------------------------
def _check_plan(
    numels: list[int], esizes: list[int], chunk: int
) -> list[list[tuple[int, int, int]]]:
    units = plan_chunks(numels, esizes, chunk)
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(numels))}
    order = []
    for unit in units:
        assert unit, "empty unit"
        nbytes = sum((b - a) * esizes[i] for i, a, b in unit)
        single_element_overflow = len(unit) == 1 and unit[0][2] - unit[0][1] == 1
        assert nbytes <= chunk or single_element_overflow, (unit, nbytes)
        for i, a, b in unit:
            assert 0 <= a < b <= numels[i]
            covered[i].append((a, b))
            order.append((i, a))
    assert order == sorted(order), "pieces must be issued in tensor / element order"
    for i, n in enumerate(numels):
        spans = covered[i]
        if n == 0:
            assert spans == []
            continue
        assert spans[0][0] == 0 and spans[-1][1] == n
        for (_, b0), (a1, _) in zip(spans, spans[1:]):
            assert b0 == a1, "gap or overlap"
    return units


@pytest.mark.parametrize(
    "numels,esizes,chunk",
    [
        ([10], [4], 4096),  # one small tensor: one unit
        ([1000, 3, 7, 1], [4, 4, 2, 8], 64),  # mixed sizes and dtypes
        ([0, 5, 0], [4, 4, 4], 8),  # empty tensors take no piece
        ([1 << 20], [2], 1 << 18),  # big tensor split evenly
        ([3], [16], 8),  # an element larger than the chunk
        ([33, 33, 33], [1, 1, 1], 32),
    ],
)
def test_plan_chunks_covers_everything_in_order(
    numels: list[int], esizes: list[int], chunk: int
) -> None:
    _check_plan(numels, esizes, chunk)


def test_plan_chunks_groups_small_and_splits_large() -> None:
    units = _check_plan([4, 4, 4, 100], [4, 4, 4, 4], 64)
    assert units[0][:3] == [(0, 0, 4), (1, 0, 4), (2, 0, 4)]  # 48 bytes of small tensors together
    big = [p for u in units for p in u if p[0] == 3]
    assert len(big) == 7  # 400 bytes: 16 bytes fill unit 0, then 6 more units
    assert len(_check_plan([1 << 20], [2], 1 << 18)) == 8


def test_plan_chunks_rejects_bad_chunk() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks([1], [4], 0)
    with pytest.raises(ValueError, match="one element size per tensor"):
        plan_chunks([1, 2], [4], 8)


# ---------------------------------------------------------------------------
# the parameter feeder, with fake events
# ---------------------------------------------------------------------------
class _FakeDevice:
    """Records issue / synchronize order of fake units; a token completes when synchronized."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[str, int]] = []
        self.pending: set[int] = set()
        self.max_pending_at_issue = 0
        self.counter = 0

    def unit(self, delay: float = 0.0):
        with self.lock:
            self.counter += 1
            uid = self.counter

        device = self

        class Token:
            def __init__(self) -> None:
                self.uid = uid

            def synchronize(self) -> None:
                time.sleep(delay)
                with device.lock:
                    device.pending.discard(uid)
                    device.log.append(("sync", uid))

        def issue() -> Token:
            with device.lock:
                device.max_pending_at_issue = max(device.max_pending_at_issue, len(device.pending))
                device.pending.add(uid)
                device.log.append(("issue", uid))
            return Token()

        return issue


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_feeder_bounds_units_in_flight_and_keeps_order(depth: int) -> None:
    dev = _FakeDevice()
    feeder = ChunkFeeder("test-feeder", depth)
    try:
        tickets = [feeder.submit([dev.unit(0.001) for _ in range(n)]) for n in (5, 1, 4)]
        assert tickets == [1, 2, 3]
        last = feeder.wait_issued(3, timeout=10)
        assert last.uid == 10  # the token of the last unit of batch 3
        issued = [uid for what, uid in dev.log if what == "issue"]
        assert issued == list(range(1, 11))
        # before issuing a unit, fewer than `depth` were still pending
        assert dev.max_pending_at_issue <= depth - 1
        assert feeder.max_inflight_seen == depth
    finally:
        feeder.close()


def test_feeder_answers_old_and_empty_batches_with_a_later_token() -> None:
    dev = _FakeDevice()
    feeder = ChunkFeeder("test-feeder", 2)
    try:
        assert feeder.last_ticket == 0
        feeder.submit([dev.unit(), dev.unit()])
        feeder.submit([dev.unit()])
        assert feeder.wait_issued(2, timeout=10).uid == 3
        # ticket 1's token was pruned; the later one implies it (stream order)
        assert feeder.wait_issued(1, timeout=10).uid == 3
        t = feeder.submit([])  # nothing to copy: answered with the last unit's token
        assert feeder.wait_issued(t, timeout=10).uid == 3
    finally:
        feeder.close()


def test_feeder_error_reaches_waiters_and_later_submits() -> None:
    feeder = ChunkFeeder("test-feeder", 2)
    try:

        def bad() -> None:
            raise RuntimeError("copy failed")

        t = feeder.submit([bad])
        with pytest.raises(RuntimeError, match="parameter upload failed"):
            feeder.wait_issued(t, timeout=10)
        with pytest.raises(RuntimeError, match="parameter upload failed"):
            feeder.submit([])
    finally:
        feeder.close()


def test_feeder_wait_times_out_instead_of_hanging() -> None:
    gate = threading.Event()

    class Token:
        def synchronize(self) -> None:
            pass

    def slow() -> Token:
        gate.wait(10)
        return Token()

    feeder = ChunkFeeder("test-feeder", 1)
    try:
        t = feeder.submit([slow])
        with pytest.raises(TimeoutError, match="not issued"):
            feeder.wait_issued(t, timeout=0.05)
        gate.set()
        assert feeder.wait_issued(t, timeout=10) is not None
    finally:
        feeder.close()


def test_feeder_close_stops_thread_and_refuses_work() -> None:
    feeder = ChunkFeeder("test-feeder", 1)
    feeder.close()
    assert not feeder._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        feeder.submit([])
    with pytest.raises(ValueError, match="depth"):
        ChunkFeeder("x", 0)


# ---------------------------------------------------------------------------
# pin_model and slab packing
# ---------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.emb(x)) * self.scale))


def test_pin_model_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="pin_model must be one of 'alloc', 'register', 'off'"):
        memory.pin_model(nn.Linear(2, 2), "always")


@pytest.mark.parametrize("mode", ["alloc", "register", "off"])
def test_pin_model_is_a_no_op_on_the_cpu_backend(mode: str, no_cuda: None) -> None:
    model = _Tied()
    ptrs = [p.data_ptr() for p in model.parameters()]
    for handle in (memory.pin_model(model, mode), memory.pin_model(model, mode, enabled=False)):
        assert handle.active is False and handle.nbytes == 0
        handle.release()
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_pack_slabs_aligns_fits_and_never_overlaps() -> None:
    sizes = [100, 700, 5000, 3, 2048, 9000, 1]
    placement = memory.pack_slabs(sizes, slab_bytes=4096)
    spans: dict[int, list[tuple[int, int]]] = {}
    for size, (slab, off) in zip(sizes, placement):
        assert off % 512 == 0
        spans.setdefault(slab, []).append((off, off + size))
    for ranges in spans.values():
        ranges.sort()
        for (_, b0), (a1, _) in zip(ranges, ranges[1:]):
            assert b0 <= a1
    # oversize storages open a power-of-two slab at offset 0; small ones fill the rest
    assert placement[2] == (1, 0) and placement[5] == (2, 0)
    assert placement[6] == (1, 5120)  # slab 0 is full by then (4096 bytes used)
    assert memory.slab_sizes(sizes, placement) == [4096, 5121, 9000]
    caps = {0: 4096, 1: 8192, 2: 16384}
    for slab, n in enumerate(memory.slab_sizes(sizes, placement)):
        assert n <= caps[slab]
    with pytest.raises(ValueError):
        memory.pack_slabs([1], 0)


def test_page_ranges_merge_shared_pages() -> None:
    spans = [
        (4096 * 3 + 100, 50),
        (4096 * 3 + 200, 5000),
        (4096 * 10, 4096),
        (0, 0),
        (4096 * 11, 1),
    ]
    assert memory.page_ranges(spans, page=4096) == [(4096 * 3, 4096 * 2), (4096 * 10, 4096 * 2)]
    with pytest.raises(ValueError, match="page"):
        memory.page_ranges(spans, page=0)


def test_packing_keeps_values_ties_views_and_training() -> None:
    torch.manual_seed(0)
    model = _Tied()
    ref = _Tied()
    ref.load_state_dict(model.state_dict())
    # A parameter that is a view into another tensor's storage.
    base = torch.randn(12)
    model.extra = nn.Parameter(base[2:8].view(2, 3))
    x = torch.randint(0, 11, (4, 5))
    y_before = model(x)
    params_before = list(model.parameters())

    nbytes, slabs = memory.pack_module_tensors(
        list(model.parameters()) + list(model.buffers()), pin=False, slab_bytes=1024
    )
    assert slabs >= 2 and nbytes > 0
    assert list(model.parameters()) == params_before  # same Parameter objects
    assert model.head.weight is model.emb.weight
    torch.testing.assert_close(model(x), y_before, rtol=0, atol=0)
    torch.testing.assert_close(model.extra.detach(), base[2:8].view(2, 3), rtol=0, atol=0)
    # small tensors share slabs now
    storages = {
        t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())
    }
    assert len(storages) == slabs
    # training through the packed parameters matches the unpacked model
    for m in (model, ref):
        opt = torch.optim.SGD([p for n, p in m.named_parameters() if n != "extra"], lr=0.1)
        m(x).square().mean().backward()
        opt.step()
    for (n, p), (_, q) in zip(
        [(n, p) for n, p in model.named_parameters() if n != "extra"], ref.named_parameters()
    ):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


# ---------------------------------------------------------------------------
# the conftest helpers every engine test uses
# ---------------------------------------------------------------------------
def test_pool_devices_fixture(pool_devices, device_kind: str) -> None:
    if device_kind == "cpu":
        assert pool_devices(3) == "cpu:3"
    else:
        devs = pool_devices(3)
        n = torch.cuda.device_count()
        assert devs == [torch.device("cuda", i % n) for i in range(3)]


# ===========================================================================
# On a GPU
# ===========================================================================
@pytest.fixture
def worker():
    w = CUDAWorker(0, torch.device("cuda", 0), param_chunk_bytes=4096, param_inflight_chunks=2)
    yield w
    w.close()


def _on(w: CUDAWorker, fn, *args):
    return w.submit(fn, *args).result(timeout=60)


@pytest.mark.cuda
def test_cuda_streams_and_priorities(worker: CUDAWorker) -> None:
    streams = {
        worker.param_stream,
        worker.activation_stream,
        worker.compute_stream,
        worker.download_stream,
    }
    assert len(streams) == 4
    assert worker.activation_stream.priority < worker.param_stream.priority
    assert _on(worker, torch.cuda.current_stream) == worker.compute_stream
    # free + reserved by this process: within what the card has, near what is free now
    free, total = torch.cuda.mem_get_info(0)
    expect = free + torch.cuda.memory_reserved(0)
    assert 0 < worker.memory_capacity() <= total
    assert abs(worker.memory_capacity() - expect) < 256 * 1024**2


@pytest.mark.cuda
def test_cuda_chunked_param_upload_roundtrip(worker: CUDAWorker) -> None:
    torch.manual_seed(0)
    host = [
        torch.randn(3000),  # 12 KB: split into 4 KB pieces
        torch.randn(7, 5).t(),  # non-contiguous
        torch.empty(0),
        torch.randint(0, 100, (33,), dtype=torch.int64),
        torch.randn(64, 64, dtype=torch.bfloat16).pin_memory(),
    ]

    def job():
        dev = worker.copy_in(host, "param")
        worker.wait_channel("param")
        with worker.compute():
            doubled = [d * 2 if d.is_floating_point() else d + 1 for d in dev]
        out = worker.copy_out(doubled)
        worker.release(dev, "param")
        return out

    out = _on(worker, job)
    for h, o in zip(host, out):
        expect = h * 2 if h.is_floating_point() else h + 1
        torch.testing.assert_close(o, expect, rtol=0, atol=0)
        # results are pageable: the page-locked memory is the worker's staging ring,
        # allocated once (downloads.py), never one pinned block per download
        assert not o.is_pinned()
    assert worker._feeder.max_inflight_seen <= 2
    assert worker.ledger.current["param"] == 0
    assert worker.ledger.peak["param"] == sum(h.numel() * h.element_size() for h in host)


@pytest.mark.cuda
def test_cuda_released_memory_is_not_reused_under_running_compute(worker: CUDAWorker) -> None:
    """Free an upload while compute still reads it, upload new data at once: result unchanged."""
    n = 1 << 22
    first = torch.ones(n).pin_memory()
    second = torch.full((n,), 7.0).pin_memory()

    def job():
        dev = worker.copy_in([first], "activation")
        worker.wait_channel("activation")
        with worker.compute():
            torch.cuda._sleep(50_000_000)  # keep the compute stream busy
            total = dev[0].sum()
        worker.release(dev, "activation")
        del dev
        again = worker.copy_in([second], "activation")  # may land in the freed block
        worker.wait_channel("activation")
        out = worker.copy_out([total])
        worker.release(again, "activation")
        return out[0]

    assert _on(worker, job).item() == float(n)


@pytest.mark.cuda
def test_cuda_rng_state_replays_dropout(worker: CUDAWorker) -> None:
    def job():
        with worker.compute():
            x = torch.ones(4096, device=worker.device)
            state = worker.get_rng_state()
            m1 = torch.nn.functional.dropout(x, 0.5)
            worker.set_rng_state(state)
            m2 = torch.nn.functional.dropout(x, 0.5)
            m3 = torch.nn.functional.dropout(x, 0.5)
        return worker.copy_out([m1, m2, m3])

    m1, m2, m3 = _on(worker, job)
    assert torch.equal(m1, m2) and not torch.equal(m1, m3)


@pytest.mark.cuda
def test_cuda_timing_events(worker: CUDAWorker) -> None:
    def job():
        t0 = worker.time_point()
        with worker.compute():
            torch.cuda._sleep(1_000_000)
        t1 = worker.time_point()
        return worker.elapsed_ms(t0, t1)

    assert _on(worker, job) > 0


@pytest.mark.cuda
def test_cuda_stage_matches_cpu_through_worker_primitives(worker: CUDAWorker) -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(5, 16)
    ref_out = layer(x)
    ref_out.square().sum().backward()
    ref_grads = [p.grad.clone() for p in layer.parameters()]
    params = [p.detach() for p in layer.parameters()]

    def job():
        dev = worker.copy_in(params, "param")
        dx = worker.copy_in([x], "activation")
        worker.wait_channel("param")
        worker.wait_channel("activation")
        with worker.compute():
            leaves = [d.requires_grad_(True) for d in dev]
            w1, b1, w2, b2 = leaves
            out = torch.nn.functional.linear(
                torch.nn.functional.gelu(torch.nn.functional.linear(dx[0], w1, b1)), w2, b2
            )
            out.square().sum().backward()
        host = worker.copy_out([out] + [p.grad for p in leaves])
        worker.release(dev, "param")
        worker.release(dx, "activation")
        return host

    host = _on(worker, job)
    torch.testing.assert_close(host[0], ref_out.detach(), rtol=1e-5, atol=1e-5)
    for g, r in zip(host[1:], ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_two_workers_share_one_gpu() -> None:
    ws = [CUDAWorker(i, torch.device("cuda", 0)) for i in range(2)]
    try:
        data = [torch.randn(1000) for _ in ws]

        def job(w: CUDAWorker, h: torch.Tensor) -> torch.Tensor:
            d = w.copy_in([h], "activation")
            w.wait_channel("activation")
            with w.compute():
                r = d[0].cumsum(0)
            out = w.copy_out([r])[0]
            w.release(d, "activation")
            return out

        futs = [w.submit(job, w, h) for w, h in zip(ws, data)]
        for f, h in zip(futs, data):
            torch.testing.assert_close(f.result(timeout=60), h.cumsum(0), rtol=1e-5, atol=1e-4)
    finally:
        for w in ws:
            w.close()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["alloc", "register"])
def test_cuda_pin_model_modes(mode: str) -> None:
    torch.manual_seed(0)
    model = _Tied()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    handle = memory.pin_model(model, mode, slab_bytes=1 << 20)
    try:
        assert handle.active and handle.nbytes > 0
        for p in list(model.parameters()) + list(model.buffers()):
            assert p.is_pinned()
        assert model.head.weight is model.emb.weight
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, state[k], rtol=0, atol=0)
        again = memory.pin_model(model, mode)  # already pinned: nothing to do
        assert not again.active
    finally:
        handle.release()
    assert not handle.registered


# ---------------------------------------------------------------------------
# the whole engine through CUDAWorker's code, on CPU ("fake CUDA")
# ---------------------------------------------------------------------------
@pytest.mark.skipif(
    memory.cuda_available(),
    reason="a real GPU is here: the cuda-marked tests drive the real worker",
)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_engine_through_cuda_worker_logic_matches_pytorch(fake_cuda: type, grain: str) -> None:
    import copy

    from roundpipe_core import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 12)]
    layers += [nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Dropout(0.2)) for _ in range(4)]
    layers.append(nn.Linear(12, 4))
    model = nn.Sequential(*layers)
    x, y = torch.randn(7, 8), torch.randn(7, 4)

    # Dropout layers in eval mode: the reference draws no random numbers (RNG replay
    # is covered by test_recompute on every backend).
    ref = copy.deepcopy(model).eval()
    ref_loss = ((ref(x) - y) ** 2).sum()
    ref_loss.backward()
    model.eval()
    rp = RoundPipe(model, devices=["cuda:0"] * 3, pin_model="off")
    try:
        assert all(isinstance(w, fake_cuda) for w in rp.pool.workers)
        plan = ModelExecutePlan(
            [range(0, 3), range(3, 5)], [range(5, 6), range(4, 5), range(2, 4), range(0, 2)]
        )
        cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan, recompute_grain=grain)
        loss = rp.forward_backward(
            (x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum(), run_config=cfg
        )
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        got = dict(rp.optim_named_parameters())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n].grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)
        for w in rp.pool.workers:
            # parameters went through the chunked feeder; every upload was released
            assert w._feeder.last_ticket > 0 and w._feeder.max_inflight_seen == 2
            assert w.ledger.current.get("param", 0) == 0
            assert w.ledger.current.get("activation", 0) == 0
            # compute waited on upload events
            assert w.compute_stream.waited
    finally:
        rp.close()


def test_routing_cpu_workers_to_cuda(
    monkeypatch: pytest.MonkeyPatch, route_cpu_workers_to_cuda: None
) -> None:
    """ROUNDPIPE_TEST_DEVICE=cuda turns the CPU workers a test asks for into CUDA workers."""
    from roundpipe_core.running.devices import pool

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda0 = torch.device("cuda", 0)
    assert pool.resolve_devices("cpu:3") == [cuda0] * 3
    assert pool.resolve_devices(4) == [cuda0] * 4  # more workers than GPUs: they share
    n_default = int(os.environ.get("ROUNDPIPE_CPU_DEVICES", "2"))
    assert pool.resolve_devices(None) == [cuda0] * n_default  # the CPU default count
    assert pool.resolve_devices(["cpu", "cuda:0"]) == [cuda0, cuda0]
    with pytest.raises(ValueError):
        pool.resolve_devices("cpu:0")
