"""One rank of the sharded-host-state tests: ``python _shard_worker.py SCENARIO OUT_DIR``.

Same launch as ``_worker.py`` (``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_*``), 2 CPU workers.

Scenarios:
    equiv -- the same AdamW training (accumulation 2, clipping by the global norm) with
             ``DataParallel(shard_host_state=False)`` and ``True``, in three modes:
             ``sync`` (an fp32 model, shared masters), ``separate`` (a bf16 model with
             fp32 masters, synchronous: the masters sharded too) and ``async`` (an fp32
             model with separate masters, ``attach(async_step=True)`` and
             ``step(is_async=True)``: one step stale, the masters sharded too, their
             updates published into the model ahead of the next step);
             saves the weights, the masters this rank holds, the clipping norms and the
             bytes each rank holds, and whether a sharded ``separate`` run refuses
             ``step(is_async=True)``.
    ckpt  -- for each mode of ``$MODE`` (comma-separated: sync, separate, async), one
             after the other in the same processes: trains 2 steps sharded, saves each
             rank's shard (``$CKPT_DIR/MODE``), trains 2 more (the reference); with
             ``$RESUME=1`` instead loads the shards written by any rank count and trains
             the 2 more steps. Its files go to ``OUT_DIR/MODE``.
    kill  -- rank ``$FAIL_RANK`` dies inside its backward at step 3 (sharded); with
             ``$FAIL_MODE=stall_in_step`` it stalls inside its optimizer step instead,
             so the others wait in the all-gather (its own group's timeout); ``$MODE``
             as for ``ckpt`` (default sync).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import load_distributed, shard  # noqa: E402
from torch import nn  # noqa: E402

from roundpipe_core import RoundPipe, RoundPipeRunConfig  # noqa: E402
from roundpipe_core.running.host_memory import estimate_host_memory  # noqa: E402

D = load_distributed()

WIDTH, BLOCKS, GLOBAL_BATCH, ACCUM, STEPS = 16, 8, 12, 2, 3
MAX_NORM = 0.05  # small enough that every step clips (the test checks the norms)
BUCKET_BYTES = 700  # several buckets per owner


def build_blocks(seed: int = 0) -> nn.Sequential:
    """Equal blocks (as a transformer's: 8 of them split evenly over 2 and 4 ranks with
    whole-tensor shards), plus a frozen one that stays out of the shards."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)
    ]
    frozen = nn.Linear(WIDTH, WIDTH)
    frozen.requires_grad_(False)
    layers.insert(2, frozen)
    return nn.Sequential(*layers)


def make_data(steps: int, seed: int = 7) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(GLOBAL_BATCH, WIDTH, generator=g),
                torch.randn(GLOBAL_BATCH, WIDTH, generator=g),
            )
            for _ in range(ACCUM)
        ]
        for _ in range(steps)
    ]


MODES = ("sync", "separate", "async")


def make_rp(rank: int, mode: str) -> RoundPipe:
    """``sync``: an fp32 model whose parameters are their own masters; ``separate``: a
    bf16 model with fp32 masters (two copies, the all-gather writes the bf16 weights);
    ``async``: an fp32 model with separate fp32 masters (what an asynchronous step needs)."""
    net = build_blocks(seed=rank)  # rank-specific: attach() broadcasts rank 0's
    return RoundPipe(
        net.to(torch.bfloat16) if mode == "separate" else net,
        optim_dtype=torch.float32,
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
        shared_masters=mode == "sync",
    )


class Run:
    """A RoundPipe, its AdamW and the DataParallel wrapper, trained as the strategy does."""

    def __init__(self, rank: int, world: int, sharded: bool, mode: str) -> None:
        self.rank, self.world, self.mode = rank, world, mode
        self.is_async = mode == "async"
        self.rp = make_rp(rank, mode)
        self.dtype = next(self.rp.model.parameters()).dtype
        self.opt = torch.optim.AdamW(self.rp.optim_parameters(), lr=0.02, weight_decay=0.1)
        self.dp = D.DataParallel(bucket_bytes=BUCKET_BYTES, shard_host_state=sharded)
        self.dp.attach(self.rp, [self.opt], async_step=self.is_async)
        self.norms: list[float] = []
        self.grad_bytes_after_reduce = 0
        self.buffer_ptrs: list[list[int]] = []  # the collectives' kept buffers, per step

    def micro(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        denom = (GLOBAL_BATCH // self.world) * ACCUM
        return self.rp.forward_backward(
            input_args=(shard(x, self.rank, self.world).to(self.dtype),),
            label=shard(y, self.rank, self.world),
            loss_fn=lambda o, t: ((o - t) ** 2).sum() / denom,
        )

    def train(self, windows) -> None:
        opt, dp = self.opt, self.dp
        for window in windows:
            for x, y in window[:-1]:
                self.micro(x, y)
            dp.wrap_closure(opt, lambda last=window[-1]: self.micro(*last))()
            dp.reduce(opt)
            self.grad_bytes_after_reduce = sum(
                p.grad.numel() * p.grad.element_size()
                for p in self.rp.optim_parameters()
                if p.grad is not None
            )
            self.norms.append(float(dp.clip_grad_norm_(opt, MAX_NORM)))

            def step() -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)
                dp.after_step(opt)
                # (here: an asynchronous step runs after rp.step returns)
                self.buffer_ptrs.append([t.data_ptr() for t in self.kept_buffers()])

            self.rp.step(step, is_async=self.is_async)
        self.rp.synchronize()

    def kept_buffers(self) -> list[torch.Tensor]:
        """The flat buffers the reduction (sharded or not) and the all-gather keep between
        steps."""
        shard = self.dp.shard(self.opt)
        reducer = self.dp._reducers.get(id(self.opt))  # (none in one process)
        ring = [] if reducer is None else reducer.kept_buffers()
        return ring + ([] if shard is None else list(shard._gather_flat.values()))

    def _buffers_reused(self) -> bool:
        """The same buffers at every step: an asynchronous step's all-gather buffer comes
        with the first publication (the second step's, which runs ahead of it), the others
        with the first reduction; none is made again."""
        first, later = self.buffer_ptrs[0], self.buffer_ptrs[1:]
        return all(p == later[0] for p in later) and later[0][: len(first)] == first

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.rp.model.named_parameters()}

    def held_masters(self) -> dict[str, torch.Tensor]:
        """The masters this rank holds values for (its share, sharded), by name."""
        released = self.rp.masters.released
        return {
            n: m.detach().clone()
            for n, m in self.rp.optim_named_parameters()
            if id(m) not in released
        }

    def bytes_held(self) -> dict[str, int]:
        masters = self.rp.masters  # the separate fp32 copies (none where shared)
        shards = self.world if self.dp.shard_host_state else 1
        budget = estimate_host_memory(
            self.rp, optimizer=[self.opt], state_shards=shards, async_step=self.is_async
        )
        return {
            "budget_optimizer_state": budget.optimizer_state,
            "optimizer_state": D.state_bytes(self.opt),
            # what the masters' storage holds (a released one: a few bytes)
            "separate_masters": sum(m.untyped_storage().nbytes() for _, _, m in masters.copies),
            "budget_masters": budget.masters,
            "grads_after_reduce": self.grad_bytes_after_reduce,
            "kept_buffers": sum(t.untyped_storage().nbytes() for t in self.kept_buffers()),
            "budget_kept_buffers": self.dp.kept_buffer_bytes(self.rp, [self.opt]),
            "buffers_reused": self._buffers_reused(),
        }

    def close(self) -> None:
        self.dp.detach()
        self.rp.close()


def run_equiv(rank: int, world: int, out: Path) -> None:
    info: dict = {}
    data = make_data(STEPS)
    for mode in MODES:
        for sharded in (False, True):
            name = f"{mode}_{'sharded' if sharded else 'plain'}"
            run = Run(rank, world, sharded, mode)
            try:
                run.train(data)
                torch.save(run.params(), out / f"{name}_rank{rank}.pt")
                torch.save(run.held_masters(), out / f"{name}_masters_rank{rank}.pt")
                info[name] = {
                    "norms": run.norms,
                    "bytes": run.bytes_held(),
                    "in_sync": D.params_in_sync(run.rp),
                    "released": len(run.rp.masters.released),
                }
                if sharded:
                    info[name]["owned"] = len(run.dp.shard(run.opt).owned)
                if sharded and mode == "separate":
                    try:  # the released masters' values come inside the step: never async
                        run.rp.step(lambda: None, is_async=True)
                        info[name]["async_refused"] = ""
                    except ValueError as exc:
                        info[name]["async_refused"] = str(exc)
            finally:
                run.close()
    (out / f"info_rank{rank}.json").write_text(json.dumps(info))


def run_ckpt(rank: int, world: int, out: Path) -> None:
    """``run_ckpt_mode`` for each mode of ``$MODE``: one launch serves them all (starting
    processes is most of such a scenario's time on a 2-core machine)."""
    for mode in os.environ.get("MODE", "sync").split(","):
        run_ckpt_mode(rank, world, out, mode)
        D.barrier()


def run_ckpt_mode(rank: int, world: int, out: Path, mode: str) -> None:
    """Train 2 steps sharded and save each rank's shard, then 2 more (the reference); or,
    with ``$RESUME=1``, load the shards (any rank count wrote them) and train the 2 more."""
    ckpt = Path(os.environ["CKPT_DIR"]) / mode
    out = out / mode
    out.mkdir(parents=True, exist_ok=True)
    data = make_data(4)
    run = Run(rank, world, sharded=True, mode=mode)
    try:
        if os.environ.get("RESUME") == "1":
            run.dp.load_state(ckpt, run.rp, run.opt)
            merged = D.merge_shards(ckpt)  # (the test's check; a real resume never merges)
            names = dict(run.rp.optim_named_parameters())
            held = run.held_masters()  # this rank's share (all of them unsharded)
            exact = all(torch.equal(held[n], merged["masters"][n]) for n in held)
            # every rank's model weights: the saved masters, in the weights' dtype
            weights = dict(run.rp.model.named_parameters())
            exact &= all(
                torch.equal(weights[n], t.to(weights[n].dtype))
                for n, t in merged["masters"].items()
            )
            index = {
                n: i
                for g in merged["optimizer"]["param_groups"]
                for i, n in zip(g["params"], g["param_names"])
            }
            for n, p in names.items():
                if p in run.opt.state:
                    saved = merged["optimizer"]["state"][index[n]]
                    exact &= all(torch.equal(v, saved[k]) for k, v in run.opt.state[p].items())
            info = {"restored_exactly": exact, "state_entries": len(run.opt.state)}
            run.train(data[2:])
            torch.save(run.params(), out / f"resumed_rank{rank}.pt")
            torch.save(run.held_masters(), out / f"resumed_masters_rank{rank}.pt")
        else:
            run.train(data[:2])
            run.dp.save_state(ckpt, run.rp, run.opt)
            D.barrier()
            run.train(data[2:])
            torch.save(run.params(), out / f"continued_rank{rank}.pt")
            torch.save(run.held_masters(), out / f"continued_masters_rank{rank}.pt")
            info = {"state_entries": len(run.opt.state)}
        (out / f"ckpt_info_rank{rank}.json").write_text(json.dumps(info))
    finally:
        run.close()


def run_kill(rank: int, world: int, out: Path) -> None:
    fail_rank = int(os.environ.get("FAIL_RANK", "1"))
    run = Run(rank, world, sharded=True, mode=os.environ.get("MODE", "sync"))

    def die(_masters: list) -> None:
        (out / "peer_died").write_text(str(time.time()))
        os._exit(17)  # a crash in the middle of the backward pass

    def stall(*_args: object, **_kwargs: object) -> None:
        (out / "peer_stalled").write_text(str(time.time()))
        time.sleep(600)  # alive, inside its step: never reaches the all-gather

    window = make_data(1)[0]
    for step in range(10_000):
        if rank == fail_rank and step == 3:
            if os.environ.get("FAIL_MODE") == "stall_in_step":
                run.opt.step = stall  # type: ignore[method-assign]
            else:
                run.rp.register_grad_hook(die)
        run.train([window])
    (out / f"rank{rank}_finished").write_text("training ended without noticing the failed peer")


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    D.init_process_group()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if scenario == "equiv":
        run_equiv(rank, world, out)
    elif scenario == "ckpt":
        run_ckpt(rank, world, out)
    elif scenario == "kill":
        run_kill(rank, world, out)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    D.barrier()
    D.destroy_process_group()


if __name__ == "__main__":
    main()
