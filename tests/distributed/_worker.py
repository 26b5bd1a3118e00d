"""One rank of the distributed tests: ``python _worker.py SCENARIO OUT_DIR``.

Reads its place in the job from the environment (``NODE_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``ROUNDPIPE_DIST_TIMEOUT``) like a real
one-process-per-node launch, runs a RoundPipe with 2 CPU workers, and writes what
the test checks under OUT_DIR.

Scenarios:
    train  -- collectives, then several training configurations (mean/sum, overlap
              on/off, gradient accumulation, autograd backward) from rank-specific
              initial weights made identical by ``broadcast_masters``; saves params.
    kill   -- trains until rank ``$FAIL_RANK`` (default 1) dies inside its backward
              (``os._exit``); with rank 0 the rendezvous host dies too.
    stall  -- trains until rank ``$FAIL_RANK`` stops taking part (sleeps, alive): the
              other must hit the process-group timeout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import GLOBAL_BATCH, build_model, load_distributed, make_data, make_optimizer, shard  # noqa: E402

from roundpipe_core import RoundPipe, RoundPipeRunConfig  # noqa: E402

D = load_distributed()

TRAIN_CONFIGS = {
    # name: (op, overlap, accum, bucket_bytes, use_autograd_backward)
    "mean_overlap_small_buckets": ("mean", True, 1, 200, False),
    # about one bucket per tensor: each of the reducer's three flat buffers takes several
    "mean_overlap_tiny_buckets_accum2": ("mean", True, 2, 40, False),
    "sum_no_overlap_accum2": ("sum", False, 2, D.DEFAULT_BUCKET_BYTES, False),
    "mean_overlap_accum2_autograd": ("mean", True, 2, 600, True),
    "sum_overlap_one_bucket": ("sum", True, 1, D.DEFAULT_BUCKET_BYTES, False),
    # the same loop driven through DataParallel, the strategy's interface
    "dataparallel_mean_overlap_accum2": ("mean", True, 2, 400, "dataparallel"),
}
STEPS = 3


def spy_on_buffers(reducer) -> dict[int, torch.UntypedStorage]:
    """Every storage a reducer's collectives reduce, over all its rounds, by address
    (held here, so a freed one cannot come back at the same address and count once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    issue = reducer._issue

    def spying(bucket, buf):
        seen[buf.untyped_storage().data_ptr()] = buf.untyped_storage()
        return issue(bucket, buf)

    reducer._issue = spying
    return seen


def buffer_report(reducer, seen: dict[int, torch.UntypedStorage], predicted: int) -> dict:
    """What a reducer's flat buffers took over several steps, against its buckets."""
    flat = [(b.numel + len(b.params)) * b.params[0].element_size() for b in reducer.buckets]
    return {
        "storages_used": len(seen),  # distinct flat buffers the collectives ever reduced
        "storage_bytes_used": sum(st.nbytes() for st in seen.values()),
        "kept_bytes": reducer.kept_bytes,  # what it holds now, after the last step
        "predicted_bytes": predicted,
        "largest_bucket_bytes": max(flat),
        "all_buckets_bytes": sum(flat),  # a flat copy of every gradient (and the counts)
        "dtypes": len({b.dtype for b in reducer.buckets}),
    }


def make_rp(rank: int) -> RoundPipe:
    # Each rank starts from different weights: broadcast_masters must make them equal.
    return RoundPipe(
        build_model(seed=rank),
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )


def train(
    rank: int,
    world: int,
    op: str,
    overlap: bool,
    accum: int,
    bucket_bytes: int,
    autograd: bool | str,
) -> dict:
    if autograd == "dataparallel":
        return train_dataparallel(rank, world, op, overlap, accum, bucket_bytes)
    rp = make_rp(rank)
    try:
        D.broadcast_masters(rp)
        opt = make_optimizer(rp.optim_parameters())
        reducer = D.GradientAllReducer(rp, op=op, bucket_bytes=bucket_bytes, overlap=overlap)
        seen = spy_on_buffers(reducer)
        # sum over ranks of (sum_local / B_global) == mean over ranks of (sum_local / B_local)
        denom = (GLOBAL_BATCH if op == "sum" else GLOBAL_BATCH // world) * accum

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((out - y) ** 2).sum() / denom

        hook_ready = 0
        for window in make_data(STEPS, accum):
            for i, (x, y) in enumerate(window):
                if i == accum - 1:
                    reducer.arm()
                xs, ys = shard(x, rank, world), shard(y, rank, world)
                if autograd:
                    loss = loss_fn(rp(xs), ys)
                    loss.backward()
                else:
                    loss = rp.forward_backward(input_args=(xs,), label=ys, loss_fn=loss_fn)
                # A collective on the default group while the reducer thread may be
                # reducing (as self.log(..., sync_dist=True) does): must not interleave.
                D.all_reduce(loss.detach(), op="mean")
            rnd = reducer._round
            if rnd is not None:  # buckets the grad hook released during the call
                hook_ready += sum(e.is_set() for e in rnd.ready)
            reducer.finish()
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        rp.synchronize()
        predicted = D.reduce_buffer_bytes(rp.optim_parameters(), world, bucket_bytes)
        buffers = buffer_report(reducer, seen, predicted)
        reducer.close()
        return {
            "params": {n: p.detach().clone() for n, p in rp.model.named_parameters()},
            "in_sync": D.params_in_sync(rp),
            "buckets": len(reducer.buckets),
            "hook_ready": hook_ready,
            "buffers": buffers,
        }
    finally:
        rp.close()


def train_dataparallel(
    rank: int, world: int, op: str, overlap: bool, accum: int, bucket_bytes: int
) -> dict:
    """The Lightning strategy's sequence of calls, without Lightning: the last micro-step
    of each window runs inside ``wrap_closure`` (as Lightning runs training_step inside
    the optimizer step's closure), then ``reduce(opt)`` and the step."""
    rp = make_rp(rank)
    dp = D.DataParallel(op=op, overlap=overlap, bucket_bytes=bucket_bytes)
    try:
        opt = make_optimizer(rp.optim_parameters())
        dp.attach(rp, [opt])  # broadcasts rank 0's weights
        seen = spy_on_buffers(dp._reducers[id(opt)])
        denom = (GLOBAL_BATCH if op == "sum" else GLOBAL_BATCH // world) * accum

        def micro_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return rp.forward_backward(
                input_args=(shard(x, rank, world),),
                label=shard(y, rank, world),
                loss_fn=lambda o, t: ((o - t) ** 2).sum() / denom,
            )

        hook_ready = 0
        for window in make_data(STEPS, accum):
            for x, y in window[:-1]:
                micro_step(x, y)
            dp.wrap_closure(opt, lambda last=window[-1]: micro_step(*last))()
            reducer = dp._reducers[id(opt)]
            hook_ready += (
                sum(e.is_set() for e in reducer._round.ready) if reducer._round is not None else 0
            )
            dp.reduce(opt)
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        rp.synchronize()
        return {
            "params": {n: p.detach().clone() for n, p in rp.model.named_parameters()},
            "in_sync": D.params_in_sync(rp),
            "buckets": len(dp._reducers[id(opt)].buckets),
            "hook_ready": hook_ready,
            # what the host-memory budget's "collective buffers" line is given
            "buffers": buffer_report(dp._reducers[id(opt)], seen, dp.kept_buffer_bytes(rp, [opt])),
        }
    finally:
        dp.detach()
        rp.close()


def none_grads(rank: int) -> dict:
    """A master without a gradient on one rank still takes part (as zeros) and gets the
    reduced gradient; one without a gradient anywhere keeps ``grad=None``."""
    rp = RoundPipe(build_model(0), devices="cpu:2")
    try:
        m = rp.optim_parameters()
        m[0].grad = torch.full_like(m[0], float(rank + 1))
        m[1].grad = torch.ones_like(m[1]) if rank == 0 else None
        m[2].grad = None
        m[3].grad = torch.full_like(m[3], float(rank))  # not in params: left alone
        outside = torch.nn.Parameter(torch.zeros(3))  # not RoundPipe's: reduced too
        outside.grad = torch.full_like(outside, 4.0 * rank)
        with D.GradientAllReducer(rp, op="mean", bucket_bytes=64, params=[*m[:3], outside]) as r:
            r.finish()
        return {
            "g0": m[0].grad.clone(),
            "g1": None if m[1].grad is None else m[1].grad.clone(),
            "g2_is_none": m[2].grad is None,
            "g3": m[3].grad.clone(),
            "outside": outside.grad.clone(),
        }
    finally:
        rp.close()


def waits_for_grad_lock(rank: int) -> dict:
    """The reducer reads and writes the masters' ``.grad`` only under their lock (the
    caller's ``synchronize()`` hands those gradients to the model meanwhile; unguarded,
    the two threads crashed the process). Held here for a while, the reduction waits."""
    rp = RoundPipe(build_model(0), devices="cpu:2")
    try:
        m = rp.optim_parameters()
        for p in m:
            p.grad = torch.full_like(p, float(rank + 1))
        reducer = D.GradientAllReducer(rp, op="sum", overlap=False)
        done = threading.Event()
        errors: list[BaseException] = []

        def reduce() -> None:
            try:
                reducer.finish()
            except BaseException as exc:  # noqa: BLE001 - reported in the result
                errors.append(exc)
            done.set()

        with rp.masters.grad_lock:
            t = threading.Thread(target=reduce)
            t.start()
            waited = not done.wait(0.5)  # still blocked on the lock after half a second
        t.join(30)
        reducer.close()
        return {
            "waited": waited,
            "finished": done.is_set() and not errors,
            "reduced": all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in m),
        }
    finally:
        rp.close()


def misuse(rank: int, world: int) -> str:
    """arm() before the first of two backward calls: finish() must refuse."""
    rp = make_rp(rank)
    try:
        D.broadcast_masters(rp)
        reducer = D.GradientAllReducer(rp, overlap=True, bucket_bytes=200)
        x, y = make_data(1, 1)[0][0]
        reducer.arm()
        for _ in range(2):
            rp.forward_backward(
                input_args=(shard(x, rank, world),),
                label=shard(y, rank, world),
                loss_fn=lambda o, t: ((o - t) ** 2).sum(),
            )
        try:
            reducer.finish()
        except RuntimeError as exc:
            return str(exc)
        return ""
    finally:
        rp.close()


def collectives(rank: int, world: int) -> dict:
    gathered = D.all_gather(torch.arange(rank + 2, dtype=torch.float32))  # sizes 2 and 3
    D.barrier()
    return {
        "mean": D.all_reduce(torch.tensor([float(rank), 10.0 * rank])).tolist(),
        "sum": D.all_reduce(torch.tensor([rank + 1]), op="sum").tolist(),
        "max": D.all_reduce(torch.tensor([float(rank)]), op="max").tolist(),
        "gather": gathered.tolist(),
        "obj": D.broadcast_object({"from": rank, "list": [rank]}, src=0),
    }


def run_train(rank: int, world: int, out: Path) -> None:
    info = {"collectives": collectives(rank, world)}
    for name, cfg in TRAIN_CONFIGS.items():
        res = train(rank, world, *cfg)
        torch.save(res["params"], out / f"{name}_rank{rank}.pt")
        info[name] = {k: res[k] for k in ("in_sync", "buckets", "hook_ready", "buffers")}
    torch.save(none_grads(rank), out / f"none_grads_rank{rank}.pt")
    info["misuse_error"] = misuse(rank, world)
    info["grad_lock"] = waits_for_grad_lock(rank)
    (out / f"info_rank{rank}.json").write_text(json.dumps(info))


def run_failure(rank: int, world: int, out: Path, mode: str) -> None:
    """Train with overlap until rank $FAIL_RANK fails at step 3 (dies in its backward, or stalls)."""
    fail_rank = int(os.environ.get("FAIL_RANK", "1"))
    rp = make_rp(rank)
    D.broadcast_masters(rp)
    opt = make_optimizer(rp.optim_parameters())
    reducer = D.GradientAllReducer(rp, bucket_bytes=200)

    def die(_masters: list) -> None:
        (out / "peer_died").write_text(str(time.time()))
        os._exit(17)  # a crash in the middle of the backward pass

    x, y = make_data(1, 1)[0][0]
    for step in range(10_000):
        if rank == fail_rank and step == 3:
            if mode == "kill":
                rp.register_grad_hook(die)
            else:
                (out / "peer_stalled").write_text(str(time.time()))
                time.sleep(600)  # alive, sockets open, never reaches the collective
        reducer.arm()
        rp.forward_backward(
            input_args=(shard(x, rank, world),),
            label=shard(y, rank, world),
            loss_fn=lambda o, t: ((o - t) ** 2).mean(),
        )
        reducer.finish()
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    (out / f"rank{rank}_finished").write_text("training ended without noticing the failed peer")


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    D.init_process_group()  # NODE_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / ROUNDPIPE_DIST_TIMEOUT
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if scenario == "train":
        run_train(rank, world, out)
        D.barrier()
        D.destroy_process_group()
    elif scenario in ("kill", "stall"):
        run_failure(rank, world, out, scenario)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
