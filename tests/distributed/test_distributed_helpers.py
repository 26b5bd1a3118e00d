"""In-process checks of ``roundpipe_core.distributed`` that need no peer:
launch-environment parsing, timeouts, argument validation, bucketing, and the
world-size-1 identities."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
from torch import nn

from roundpipe_core import RoundPipe
from roundpipe_core import distributed as D
from roundpipe_core.distributed.buckets import REDUCE_IN_FLIGHT, BufferRing, _Bucket
from roundpipe_core.distributed.reducer import _bucketize


@pytest.fixture
def rp():
    r = RoundPipe(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), devices="cpu:2")
    yield r
    r.close()


def test_torchrun_environment() -> None:
    env = D.dist_env_from_environ(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
            "LOCAL_RANK": "0",
        }
    )
    assert env == D.DistEnv(1, 2, "10.0.0.1", 29500, "torchrun")


def test_node_rank_environment() -> None:
    env = D.dist_env_from_environ(
        {"NODE_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "host-a", "MASTER_PORT": "1234"}
    )
    assert (env.rank, env.world_size, env.master_addr, env.source) == (0, 3, "host-a", "env")


def test_slurm_environment() -> None:
    env = D.dist_env_from_environ(
        {
            "SLURM_PROCID": "2",
            "SLURM_NTASKS": "4",
            "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "gpu[007-010,12],cpu1",
            "SLURM_JOB_ID": "81234",
        }
    )
    assert (env.rank, env.world_size, env.master_addr, env.source) == (2, 4, "gpu007", "slurm")
    assert env.master_port == 15000 + 1234
    # an interactive allocation's shell is not a launch
    with pytest.raises(ValueError, match="no distributed launch"):
        D.dist_env_from_environ(
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "1",
                "SLURM_JOB_NAME": "bash",
                "SLURM_NODELIST": "n1",
            }
        )


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, "no distributed launch"),
        ({"NODE_RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT"),
        (
            {"NODE_RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
            "NODE_RANK must be an integer",
        ),
        (
            {"NODE_RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
            "outside 0..1",
        ),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "a", "MASTER_PORT": "70000"}, "TCP port"),
    ],
)
def test_bad_environment_names_the_problem(env: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        D.dist_env_from_environ(env)


def test_timeout_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(D.TIMEOUT_ENV, raising=False)
    assert D.resolve_timeout() == D.DEFAULT_TIMEOUT
    assert D.resolve_timeout(12) == timedelta(seconds=12)
    monkeypatch.setenv(D.TIMEOUT_ENV, "7.5")
    assert D.resolve_timeout() == timedelta(seconds=7.5)
    monkeypatch.setenv(D.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=D.TIMEOUT_ENV):
        D.resolve_timeout()
    with pytest.raises(ValueError, match="positive"):
        D.resolve_timeout(0)
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="positive, finite"):
            D.resolve_timeout(bad)
    with pytest.raises(ValueError, match="too large"):
        D.resolve_timeout(1e30)
    monkeypatch.setenv(D.TIMEOUT_ENV, "inf")
    with pytest.raises(ValueError, match=D.TIMEOUT_ENV):
        D.resolve_timeout()
    with pytest.raises(TypeError):
        D.resolve_timeout("10")


def test_reducer_validates_arguments(rp: RoundPipe) -> None:
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        D.GradientAllReducer(rp, op="avg")
    with pytest.raises(ValueError, match="bucket_bytes"):
        D.GradientAllReducer(rp, bucket_bytes=0)
    with pytest.raises(TypeError, match="needs a RoundPipe"):
        D.GradientAllReducer(nn.Linear(2, 2))


def test_buckets_are_reverse_order_and_capped(rp: RoundPipe) -> None:
    masters = rp.optim_parameters()  # 0.weight(32) 0.bias(8) 2.weight(16) 2.bias(2) floats
    r = D.GradientAllReducer(rp, bucket_bytes=4 * 20, overlap=False)
    order = [p for b in r.buckets for p in b.params]
    assert [id(p) for p in order] == [id(p) for p in reversed(masters)]
    assert [[p.numel() for p in b.params] for b in r.buckets] == [[2, 16], [8], [32]]
    r.close()


def test_mixed_dtypes_get_separate_buckets() -> None:
    ts = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    assert [len(b) for b in _bucketize(ts, 1 << 20)] == [1, 2]


def test_ring_never_refills_a_slot_still_in_flight() -> None:
    """Buckets of mixed dtypes and sizes, in reduction order: a bucket's slot is never the
    buffer of one of the ``REDUCE_IN_FLIGHT`` buckets before it (those may still be in
    flight when it is flattened), it fits its slot, each dtype has at most
    ``REDUCE_IN_FLIGHT + 1`` buffers, never more bytes than a buffer per bucket, and
    ``BufferRing.nbytes`` / ``reduce_buffer_bytes`` say what the ring makes."""
    g = torch.Generator().manual_seed(3)
    # a run of fp32 tensors, then fp32 and bf16 pairs alternating, then one fp64
    dtypes = [torch.float32 if i < 16 or i % 4 < 2 else torch.bfloat16 for i in range(40)]
    params = [torch.zeros(int(torch.randint(1, 40, (1,), generator=g)), dtype=d) for d in dtypes]
    params.append(torch.zeros(5, dtype=torch.float64))
    groups = _bucketize(list(reversed(params)), 64)
    buckets = [_Bucket(i, b) for i, b in enumerate(groups)]
    ring = BufferRing(buckets)
    views = [ring.slot(b) for b in buckets]
    owner = [v.untyped_storage().data_ptr() for v in views]
    for k, b in enumerate(buckets):
        assert views[k].numel() == b.flat_numel and views[k].dtype == b.dtype
        assert owner[k] not in owner[max(0, k - REDUCE_IN_FLIGHT) : k], k
    per_dtype: dict[torch.dtype, set[int]] = {}
    for b, ptr in zip(buckets, owner):
        per_dtype.setdefault(b.dtype, set()).add(ptr)
    counts = {d: sum(b.dtype == d for b in buckets) for d in per_dtype}
    assert {d: len(p) for d, p in per_dtype.items()} == {
        d: min(n, REDUCE_IN_FLIGHT + 1) for d, n in counts.items()
    }
    assert counts[torch.float32] > 3 * (REDUCE_IN_FLIGHT + 1) and counts[torch.float64] == 1
    kept = sum(t.untyped_storage().nbytes() for t in ring.buffers())
    assert kept == BufferRing.nbytes(groups) == D.reduce_buffer_bytes(params, 2, 64)
    assert kept < sum(b.flat_numel * b.params[0].element_size() for b in buckets)
    assert D.reduce_buffer_bytes(params, 1, 64) == 0  # one process reduces nothing


def test_single_process_is_an_identity(rp: RoundPipe) -> None:
    """Without a process group (or with world size 1) everything is a cheap no-op."""
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
    before = [p.grad.clone() for p in rp.optim_parameters()]
    with D.GradientAllReducer(rp) as r:
        r.arm()
        r.finish()
    D.sync_gradients(rp)
    D.broadcast_masters(rp)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, rp.optim_parameters()))
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(D.all_reduce(t), t)
    assert torch.equal(D.all_reduce(torch.tensor([3]), op="mean"), torch.tensor([3.0]))
    assert D.all_gather(t).shape == (1, 2)
    assert D.broadcast_object({"a": 1}) == {"a": 1}
    assert D.params_in_sync(rp)
    D.barrier()
    with pytest.raises(ValueError, match="op must be"):
        D.all_reduce(t, op="avg")


def test_close_removes_the_grad_hook(rp: RoundPipe) -> None:
    r = D.GradientAllReducer(rp, overlap=True)
    assert len(rp._grad_hooks) == 1
    r.close()
    assert rp._grad_hooks == []


def test_the_reducer_waits_for_the_masters_grad_lock(rp: RoundPipe) -> None:
    """The reducer reads and writes the masters' ``.grad`` only under their grad lock
    (``synchronize()`` hands those gradients to the model under it; unguarded, the two
    threads crashed a process: b2ca0f9). In one process, the collective faked as a peer
    holding the same gradients: while the lock is held the reduction waits, then sums.
    (tests/distributed/test_data_parallel.py checks the same with two real ranks.)"""
    masters = rp.optim_parameters()
    for p in masters:
        p.grad = torch.ones_like(p)
    r = D.GradientAllReducer(rp, op="sum", overlap=False)

    class Done:
        def wait(self, *timeout: object) -> bool:
            return True

    def issue(bucket: object, buf: torch.Tensor) -> Done:
        buf.mul_(2)  # this rank's gradients plus an equal peer's
        return Done()

    r.world_size, r._issue = 2, issue  # what a two-rank group would give
    finished = threading.Event()
    errors: list[BaseException] = []

    def reduce() -> None:
        try:
            r.finish()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)
        finished.set()

    try:
        with rp.masters.grad_lock:
            t = threading.Thread(target=reduce)
            t.start()
            assert not finished.wait(0.3), "the reduction did not wait for the grad lock"
        t.join(10)
        assert finished.is_set() and not errors, errors
        assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in masters)
    finally:
        r.close()


def test_params_select_what_is_reduced(rp: RoundPipe) -> None:
    masters = rp.optim_parameters()
    extra = nn.Parameter(torch.zeros(2))
    r = D.GradientAllReducer(rp, params=[masters[0], extra, masters[0]], overlap=False)
    assert [id(p) for b in r.buckets for p in b.params] == [
        id(extra),
        id(masters[0]),
    ]  # deduplicated, reversed
    r.close()
    with pytest.raises(TypeError, match="params must be tensors"):
        D.GradientAllReducer(rp, params=[1.0])
    with pytest.raises(RuntimeError, match="closed"):
        r.finish()


def test_dataparallel_in_one_process_is_a_no_op(rp: RoundPipe) -> None:
    dp = D.DataParallel()
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    dp.connect(None, world_size=1)  # creates no process group
    dp.attach(rp, [opt])
    calls = []
    closure = dp.wrap_closure(opt, lambda: calls.append(1) or "loss")
    assert closure() == "loss" and calls == [1]
    dp.reduce(opt)
    assert dp.kept_buffer_bytes(rp, [opt]) == 0  # no collectives, no buffers
    dp.abort()
    dp.detach()
    assert rp._grad_hooks == []
    for bad, match in (
        (dict(op="avg"), "op must"),
        (dict(bucket_bytes=0), "bucket_bytes"),
        (dict(timeout=-1), "positive"),
    ):
        with pytest.raises(ValueError, match=match):
            D.DataParallel(**bad)


@pytest.mark.host_only  # all in child processes
def test_core_module_needs_no_lightning_and_the_old_path_still_works() -> None:
    import subprocess
    import sys

    code = (
        "import sys, roundpipe_core.distributed as D; "
        "assert 'lightning' not in sys.modules, 'roundpipe_core.distributed imported Lightning'; "
        "from roundpipe_lightning import distributed as old; "
        "assert old.DataParallel is D.DataParallel and old.__all__ == D.__all__"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_nccl_binds_one_gpu_for_every_thread_and_the_barrier(monkeypatch) -> None:
    """NCCL: the group is bound to cuda:LOCAL_RANK (device_id), collectives from any
    thread use that GPU (the reducer thread's current device is cuda:0), and the
    barrier names it (device_ids) instead of NCCL's guess cuda:(rank % n)."""
    import threading

    import torch.distributed as dist

    from roundpipe_core.distributed import group as G

    calls: dict = {}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: calls.get("init") is not None)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.update(init=(a, k)))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "barrier", lambda **k: calls.update(barrier=k))
    monkeypatch.setattr(G, "_world_group", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.update(set_device=d))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # any other thread's
    try:
        G.init_process_group(backend="nccl")
        args, kwargs = calls["init"]
        assert kwargs["device_id"] == torch.device("cuda", 1)
        assert calls["set_device"] == torch.device("cuda", 1)
        seen = []
        t = threading.Thread(target=lambda: seen.append(G.comm_device()))
        t.start()
        t.join()
        assert seen == [torch.device("cuda", 1)]
        G.barrier()
        assert calls["barrier"]["device_ids"] == [1]
    finally:
        G._nccl_device = None


def test_nccl_without_a_gpu_is_a_clear_error(monkeypatch) -> None:
    from roundpipe_core.distributed import group as G

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="backend='nccl' needs a CUDA GPU"):
        G._local_gpu(None, 0)
