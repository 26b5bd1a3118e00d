"""Train a Qwen3-1.7B-shaped model (random weights) for a few steps and report throughput.

One engine per process (GPU memory statistics stay clean)::

    python benchmarks/gpu_train.py --engine roundpipe_core --json results.jsonl
    python benchmarks/gpu_train.py --engine plain          --json results.jsonl
    python benchmarks/gpu_train.py --engine published      --json results.jsonl   # needs `roundpipe`
    python benchmarks/gpu_train.py --table results.jsonl                          # side-by-side table

    # several stages, two workers sharing one GPU, peak memory checked against its bound
    python benchmarks/gpu_train.py --engine roundpipe_core --layers 8 --devices 2 \
        --plan uniform --stages 5 --check-memory --label multi-stage --json results.jsonl

Engines:

- ``roundpipe_core``: this project. bf16 parameters in pinned host memory, fp32
  master copies, ``forward_backward`` + ``AdamW(fused=True)`` on the masters
  through ``step()`` (asynchronous, one step stale), on every visible GPU.
- ``plain``: plain PyTorch on one GPU: fp32 parameters, bf16 autocast,
  activation checkpointing of every decoder layer, ``AdamW(fused=True)`` on the
  GPU. Skipped (reported "oom") when it does not fit.
- ``published``: the published ``roundpipe`` package (PyPI ``roundpipe``),
  same model, same loss, same optimizer as ``roundpipe_core``. Only run, never copied.

The model is a pure-PyTorch replica of Qwen3-1.7B's shapes (28 decoder layers,
hidden 2048, 16 query / 8 key-value heads of 128, q/k RMSNorm, RoPE theta 1e6,
SwiGLU 6144, vocabulary 151936, tied embeddings): no download, no transformers.
As an ``nn.Sequential``: [embedding, 28 decoder layers, final norm + LM head].

``--tiny`` shrinks everything (and runs on CPU workers without a GPU) to smoke-test
the script itself.

Progress goes to stdout as it happens (flushed): the set-up time, then one line
per step with its time and loss, so a run killed by a time limit still shows
how far it got.

Each run appends one JSON object to ``--json``: engine, status (ok / oom /
error / unavailable), tokens_per_s, step_s, peak GPU memory (allocated and
reserved, GiB), and for roundpipe_core the stage sizes of the plan used.

``--check-memory`` (roundpipe_core, with a GPU) compares the peak GPU memory of
the timed steps with what the design allows each worker: its running stage
(parameters and gradients) plus the stage it prefetches plus the memory one
microbatch of its heaviest stage needs (measured alone beforehand), plus what
stays allocated between steps (library workspaces). The result row says
pass/FAIL with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GIB = 1024**3


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------
class Shape:
    def __init__(self, tiny: bool = False, layers: int | None = None) -> None:
        if tiny:
            self.vocab, self.hidden, self.layers, self.heads, self.kv_heads = 512, 64, 3, 4, 2
            self.head_dim, self.ffn = 16, 128
        else:  # Qwen3-1.7B
            self.vocab, self.hidden, self.layers, self.heads, self.kv_heads = (
                151936,
                2048,
                28,
                16,
                8,
            )
            self.head_dim, self.ffn = 128, 6144
        if layers is not None:
            self.layers = layers
        self.rope_theta = 1_000_000.0
        self.eps = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.input_norm = RMSNorm(s.hidden, s.eps)
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.eps)
        self.k_norm = RMSNorm(s.head_dim, s.eps)
        self.post_norm = RMSNorm(s.hidden, s.eps)
        self.gate_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.s
        b, t, _ = x.shape
        h = self.input_norm(x)
        q = self.q_norm(self.q_proj(h).view(b, t, s.heads, s.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(h).view(b, t, s.kv_heads, s.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        # RoPE tables computed in fp32 from the position index (device-agnostic temporaries).
        half = torch.arange(0, s.head_dim, 2, device=x.device, dtype=torch.float32) / s.head_dim
        inv_freq = 1.0 / (s.rope_theta**half)
        freqs = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = s.heads // s.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Embed(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class Head(nn.Module):
    def __init__(self, s: Shape, embed: Embed) -> None:
        super().__init__()
        self.norm = RMSNorm(s.hidden, s.eps)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.lm_head.weight = embed.embed_tokens.weight  # tied, as in Qwen3-1.7B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def build_model(
    s: Shape, device: str | torch.device, dtype: torch.dtype, seed: int = 0
) -> nn.Sequential:
    """The model, randomly initialised directly on ``device`` in ``dtype`` (fast, no fp32 detour)."""
    with torch.device("meta"):
        embed = Embed(s)
        layers = [DecoderLayer(s) for _ in range(s.layers)]
        head = Head(s, embed)
        model = nn.Sequential(embed, *layers, head)
    model = model.to_empty(device=device)
    head.lm_head.weight = embed.embed_tokens.weight  # re-tie after materialisation
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.to(dtype)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_batch(s: Shape, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s.vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def make_loss_fn(total_tokens: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Token-sum cross entropy / tokens of the whole batch: microbatch losses add up to the batch mean."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (
            F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
            )
            / total_tokens
        )

    return loss_fn


# ---------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------
def _gpu_stats(result: dict[str, Any]) -> None:
    if torch.cuda.is_available():
        result["peak_alloc_bytes"] = max(
            torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())
        )
        result["peak_alloc_gib"] = round(
            max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / GIB,
            2,
        )
        result["peak_reserved_bytes"] = max(
            torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count())
        )
        result["peak_reserved_gib"] = round(
            max(torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count())) / GIB,
            2,
        )


def _reset_gpu_stats() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
            torch.cuda.reset_peak_memory_stats(i)


def progress(msg: str) -> None:
    """One progress line, flushed at once (a killed run still shows how far it got)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _timed_loop(
    step: Callable[[], float],
    finish: Callable[[], None],
    warmup: int,
    steps: int,
    tokens: int,
    result: dict[str, Any],
    between_warmups: Callable[[int], None] | None = None,
) -> None:
    losses = []
    for i in range(warmup):
        t0 = time.perf_counter()
        losses.append(step())
        progress(
            f"warm-up step {i + 1}/{warmup}: {time.perf_counter() - t0:.2f} s, loss {losses[-1]:.4f}"
        )
        if between_warmups is not None:
            between_warmups(i)
    finish()
    _reset_gpu_stats()
    result["resident_between_steps_bytes"] = _allocated()
    t0 = time.perf_counter()
    for i in range(steps):
        t1 = time.perf_counter()
        losses.append(step())
        # async engines: the time of a step is when its call returned, the total is exact
        progress(f"step {i + 1}/{steps}: {time.perf_counter() - t1:.2f} s, loss {losses[-1]:.4f}")
    finish()
    dt = time.perf_counter() - t0
    result.update(
        status="ok",
        steps=steps,
        step_s=round(dt / steps, 3),
        tokens_per_s=round(tokens * steps / dt, 1),
        losses=[round(x, 4) for x in losses],
    )
    _gpu_stats(result)
    progress(f"timed: {result['step_s']} s/step, {result['tokens_per_s']} tokens/s")


def _allocated() -> int:
    if not torch.cuda.is_available():
        return 0
    return max(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()))


def run_roundpipe(
    args: argparse.Namespace, s: Shape, result: dict[str, Any], published: bool
) -> None:
    if published:
        import roundpipe as rp_mod  # the published package, run as is

        result["version"] = getattr(rp_mod, "__version__", "?")
    else:
        import roundpipe_core as rp_mod

    t0 = time.perf_counter()
    if torch.cuda.is_available():
        # Initialise on the GPU (seconds instead of a minute of CPU normal_), in fp32 like
        # the plain run so both start from the same weights, then keep bf16 on the host.
        model = build_model(s, "cuda", torch.float32).to(torch.bfloat16).cpu()
        torch.cuda.empty_cache()
    else:
        model = build_model(s, "cpu", torch.bfloat16)
    result["params"] = num_params(model)
    ids, labels = make_batch(s, args.batch, args.seq, seed=1)
    tokens = ids.numel()
    loss_fn = make_loss_fn(tokens)
    kwargs: dict[str, Any] = {"optim_dtype": torch.float32, "pin_model": args.pin_model}
    if not published:
        devices = _devices(args)
        if devices is not None:
            kwargs["devices"] = devices
            result["workers"] = [str(d) for d in devices] if isinstance(devices, list) else devices
    run_cfg_kwargs: dict[str, Any] = {}
    if args.num_microbatch:
        run_cfg_kwargs["num_microbatch"] = args.num_microbatch
    if run_cfg_kwargs:
        kwargs["model_run_config"] = rp_mod.RoundPipeRunConfig(**run_cfg_kwargs)
    rp = rp_mod.RoundPipe(model, **kwargs)
    opt = torch.optim.AdamW(list(rp.optim_parameters()), lr=1e-5, fused=True)
    state: dict[str, Any] = {"cfg": None}
    if not published and args.plan == "uniform":
        # A forced plan of several stages: prefetch and recompute are exercised even on one GPU.
        plan = rp_mod.ModelExecutePlan.uniform(rp.num_layers, args.stages, "fused")
        state["cfg"] = rp_mod.RoundPipeRunConfig(execute_plan=plan, **run_cfg_kwargs)
    result["setup_s"] = round(time.perf_counter() - t0, 1)
    progress(f"set-up: {result['setup_s']} s ({result['params']} parameters)")

    def step() -> float:
        fb_kwargs: dict[str, Any] = {"input_args": (ids,), "label": labels, "loss_fn": loss_fn}
        if state["cfg"] is not None:
            fb_kwargs["run_config"] = state["cfg"]
        loss = rp.forward_backward(**fb_kwargs)
        rp.step(lambda: (opt.step(), opt.zero_grad(set_to_none=True)), is_async=True)
        if isinstance(loss, (list, tuple)):
            loss = sum(float(x) for x in loss)
        return float(loss)

    def replan(i: int) -> None:
        # After a measured iteration, let our planner choose the stages (the published
        # package plans automatically by itself).
        if published or args.plan != "auto" or i != 0:
            return
        try:
            plan = rp_mod.ModelExecutePlan.auto("fused", rp)
            state["cfg"] = rp_mod.RoundPipeRunConfig(execute_plan=plan, **run_cfg_kwargs)
        except Exception as exc:  # noqa: BLE001 - report and keep the default plan
            result["plan_error"] = f"{type(exc).__name__}: {exc}"

    try:
        _timed_loop(
            step,
            rp.synchronize,
            max(args.warmup, 2 if args.plan == "auto" else 1),
            args.steps,
            tokens,
            result,
            replan,
        )
        if not published:
            _describe_plan(rp, result)
            if args.check_memory:
                _check_memory(rp, result, ids, labels, loss_fn, state["cfg"], args)
    finally:
        close = getattr(rp, "close", None)
        if callable(close):
            close()


def _devices(args: argparse.Namespace) -> Any:
    """The ``devices`` argument: ``--devices`` workers spread over the visible GPUs
    (several share a GPU when there are fewer GPUs), CPU workers without a GPU."""
    if not torch.cuda.is_available():
        return f"cpu:{args.devices or 2}" if args.tiny else None
    if not args.devices:
        return None
    n = torch.cuda.device_count()
    return [torch.device("cuda", i % n) for i in range(args.devices)]


def _stage_bytes(rp: Any, layers: range, with_grads: bool) -> int:
    nbytes = sum(
        t.numel() * t.element_size()
        for i in layers
        for t in list(rp.layers[i].parameters()) + list(rp.layers[i].buffers())
    )
    if with_grads:
        nbytes += sum(
            p.numel() * p.element_size()
            for i in layers
            for p in rp.layers[i].parameters()
            if p.requires_grad
        )
    return nbytes


def _microbatch_peak(
    rp: Any, layers: range, ids: torch.Tensor, labels: torch.Tensor, loss_fn: Any, mb: int
) -> int:
    """Bytes one microbatch of a backward / fused stage needs beyond its parameters and
    gradients: the stage alone on the GPU, forward + loss + backward, peak minus resident."""
    import copy

    dev = torch.device("cuda", 0)
    stage = [copy.deepcopy(rp.layers[i]).to(dev) for i in layers]
    n = max(1, ids.shape[0] // mb)
    x: Any = ids[:n].to(dev)
    if layers.start > 0:  # a hidden state of the right shape and dtype stands in for the input
        hidden = rp.layers[0].embed_tokens.weight
        x = torch.randn(n, ids.shape[1], hidden.shape[1], device=dev, dtype=hidden.dtype)
        x.requires_grad_(True)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    out = x
    for layer in stage:
        out = layer(out)
    if layers.stop == rp.num_layers:
        loss = loss_fn(out, labels[:n].to(dev))
    else:
        loss = out.float().square().mean()
    loss.backward()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    grads = sum(p.numel() * p.element_size() for layer in stage for p in layer.parameters())
    del stage, x, out, loss
    torch.cuda.empty_cache()
    return max(peak - grads, 0)


def _check_memory(
    rp: Any,
    result: dict[str, Any],
    ids: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Any,
    cfg: Any,
    args: argparse.Namespace,
) -> None:
    """Peak GPU memory of the timed steps vs. running + prefetched stage and one
    microbatch of its heaviest stage per worker + what stays allocated between steps."""
    if not torch.cuda.is_available():
        result["mem_check"] = "skipped (no GPU)"
        progress("memory check: skipped, no GPU here")
        return
    jobs = list(getattr(getattr(rp, "last_call", None), "schedule", None) or [])
    if not jobs or torch.cuda.device_count() != 1:
        result["mem_check"] = "skipped (needs the schedule and exactly one GPU)"
        return
    peak = int(result.get("peak_alloc_bytes", 0))
    per_worker: dict[int, list[Any]] = {}
    for job in jobs:
        per_worker.setdefault(job.device, []).append(job)
    held = 0
    for queue in per_worker.values():
        worst = 0
        for i, job in enumerate(queue):
            running = _stage_bytes(rp, job.layers, with_grads=job.kind != "forward")
            prefetched = _stage_bytes(rp, queue[i + 1].layers, False) if i + 1 < len(queue) else 0
            worst = max(worst, running + prefetched)
        held += worst
    mb = cfg.num_microbatch if cfg is not None and cfg.num_microbatch else args.num_microbatch
    mb = mb or max(len(j.microbatches) for j in jobs)
    # Workers compute side by side: each may hold one microbatch of the heaviest
    # backward / fused stage it runs at the same time as the others hold theirs.
    peaks: dict[range, int] = {}
    act = 0
    for queue in per_worker.values():
        for j in queue:
            if j.kind != "forward" and j.layers not in peaks:
                peaks[j.layers] = _microbatch_peak(rp, j.layers, ids, labels, loss_fn, mb)
        act += max((peaks[j.layers] for j in queue if j.kind != "forward"), default=0)
    # From the second microbatch on, autograd accumulates a parameter's gradient by
    # allocating the new one before adding it: one more gradient of the largest
    # parameter per worker at once (the tied embedding / LM head of the 1.7B shape)
    accum = 0
    if mb > 1:
        for queue in per_worker.values():
            accum += max(
                (_largest_grad_bytes(rp, j.layers) for j in queue if j.kind != "forward"),
                default=0,
            )
    resident = int(result.get("resident_between_steps_bytes", 0))
    bound = held + act + accum + resident
    # reserved memory may exceed allocated by the caching allocator's rounding on each
    # of a worker's four streams (assumed, by construction: not measured on a GPU yet)
    reserved_bound = bound + RESERVED_SLACK_PER_WORKER * len(per_worker)
    reserved = int(result.get("peak_reserved_bytes", 0))
    ok = peak <= bound and reserved <= reserved_bound
    result.update(
        mem_bound_gib=round(bound / GIB, 3),
        mem_reserved_bound_gib=round(reserved_bound / GIB, 3),
        mem_stages_gib=round(held / GIB, 3),
        mem_microbatch_gib=round(act / GIB, 3),
        mem_accumulation_gib=round(accum / GIB, 3),
        mem_check="pass" if ok else "FAIL",
    )
    progress(
        f"memory check: peak allocated {peak / GIB:.3f} GiB vs bound {bound / GIB:.3f} GiB = "
        f"stages held {held / GIB:.3f} (running + prefetched, {len(per_worker)} worker(s)) + a "
        f"microbatch per worker {act / GIB:.3f} + accumulated gradient {accum / GIB:.3f} + resident "
        f"{resident / GIB:.3f}; peak reserved {reserved / GIB:.3f} GiB vs "
        f"{reserved_bound / GIB:.3f}: {result['mem_check']}"
    )


#: Reserved-over-allocated memory allowed per worker in the memory check (4 streams).
RESERVED_SLACK_PER_WORKER = 4 * 64 * 1024**2


def _largest_grad_bytes(rp: Any, layers: range) -> int:
    return max(
        (
            p.numel() * p.element_size()
            for i in layers
            for p in rp.layers[i].parameters()
            if p.requires_grad
        ),
        default=0,
    )


def _describe_plan(rp: Any, result: dict[str, Any]) -> None:
    """Stage sizes of the plan last run, and the memory bound they imply."""
    jobs = getattr(getattr(rp, "last_call", None), "schedule", None) or []
    layer_bytes = [
        sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in rp.layers
    ]
    stages = []
    for job in jobs:
        nbytes = sum(layer_bytes[i] for i in job.layers)
        # backward / fused stages hold their gradients too
        stages.append((job.kind, len(job.layers), nbytes * (2 if job.kind != "forward" else 1)))
    if stages:
        letter = {"forward": "F", "fused": "X", "backward": "B"}
        result["stages"] = [f"{letter.get(k, k)}{n}" for k, n, _ in stages]
        top = sorted((b for _, _, b in stages), reverse=True)[:2]
        result["two_largest_stages_gib"] = round(sum(top) / GIB, 2)


def run_plain(args: argparse.Namespace, s: Shape, result: dict[str, Any]) -> None:
    from torch.utils.checkpoint import checkpoint

    if not torch.cuda.is_available():
        if not args.tiny:
            result.update(status="unavailable", error="no CUDA GPU")
            return
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0)
    t0 = time.perf_counter()
    model = build_model(s, device, torch.float32)
    result["params"] = num_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)
    ids, labels = make_batch(s, args.batch, args.seq, seed=1)
    ids, labels = ids.to(device), labels.to(device)
    loss_fn = make_loss_fn(ids.numel())
    embed, *blocks, head = list(model)
    result["setup_s"] = round(time.perf_counter() - t0, 1)
    progress(f"set-up: {result['setup_s']} s ({result['params']} parameters, on {device})")

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            x = embed(ids)
            for blk in blocks:
                x = checkpoint(blk, x, use_reentrant=False)
            loss = loss_fn(head(x), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def finish() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    _timed_loop(step, finish, args.warmup, args.steps, ids.numel(), result)


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    s = Shape(args.tiny, args.layers)
    result: dict[str, Any] = {
        "engine": args.label or args.engine,
        "batch": args.batch,
        "seq": args.seq,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
    }
    torch.manual_seed(0)
    try:
        if args.engine == "plain":
            run_plain(args, s, result)
        elif args.engine == "published":
            try:
                import roundpipe  # noqa: F401
            except Exception as exc:  # noqa: BLE001 - not installed: say so in the table
                result.update(status="unavailable", error=f"cannot import roundpipe: {exc}")
                return result
            run_roundpipe(args, s, result, published=True)
        else:
            run_roundpipe(args, s, result, published=False)
    except torch.cuda.OutOfMemoryError as exc:
        result.update(status="oom", error=str(exc).splitlines()[0][:200])
        _gpu_stats(result)
    except Exception as exc:  # noqa: BLE001 - one engine failing must not hide the others
        traceback.print_exc()
        result.update(
            status="error",
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
        )
        _gpu_stats(result)
    return result


# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------
def print_table(path: str) -> None:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    base = {r["engine"]: r for r in rows if r.get("status") == "ok"}
    ref = base.get("plain")
    print()
    print(
        "| engine | status | tokens/s | vs plain | s/step | first loss | peak alloc GiB | peak reserved GiB | 2 largest stages GiB | note |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tps = r.get("tokens_per_s")
        # a ratio only between runs of the same model and batch
        same = ref is not None and all(r.get(k) == ref.get(k) for k in ("params", "batch", "seq"))
        ratio = f"{tps / ref['tokens_per_s']:.2f}x" if tps and ref and same else ""
        note = r.get("error") or ""
        if r.get("stages"):
            note = (note + " " if note else "") + f"stages {','.join(r['stages'])}"
        if r.get("workers"):
            note += f" workers {r['workers']}"
        if r.get("mem_check"):
            note += f"; memory check {r['mem_check']}"
            if r.get("mem_bound_gib") is not None:
                note += (
                    f" (peak alloc {r.get('peak_alloc_gib')} <= bound {r['mem_bound_gib']} GiB: "
                    f"stages {r.get('mem_stages_gib')} + a microbatch per worker "
                    f"{r.get('mem_microbatch_gib')} + accumulated grad "
                    f"{r.get('mem_accumulation_gib')} + resident "
                    f"{round(r.get('resident_between_steps_bytes', 0) / GIB, 3)}; peak reserved "
                    f"{r.get('peak_reserved_gib')} <= {r.get('mem_reserved_bound_gib')})"
                )
        if r.get("params") and ref and r.get("params") != ref.get("params"):
            note += f"; {r['params']} params"
        if r.get("plan_error"):
            note += f" (auto plan failed: {r['plan_error'][:80]})"

        def fmt(v: Any) -> str:
            return "" if v is None else str(v)

        print(
            f"| {r.get('engine')} | {r.get('status')} | {fmt(tps)} | {ratio} | {fmt(r.get('step_s'))} | "
            f"{fmt((r.get('losses') or [None])[0])} | "
            f"{fmt(r.get('peak_alloc_gib'))} | {fmt(r.get('peak_reserved_gib'))} | "
            f"{fmt(r.get('two_largest_stages_gib'))} | {note} |"
        )
    if rows:
        r0 = next((r for r in rows if r.get("params")), rows[0])
        print(
            f"\nmodel: Qwen3-1.7B shape{' (TINY)' if r0.get('seq', 0) < 256 else ''}, params {r0.get('params', '?')}, "
            f"batch {r0.get('batch')} x seq {r0.get('seq')}; GPU {r0.get('gpu')} x{r0.get('gpus')}; torch {r0.get('torch')}"
        )
        print(
            "stages: F = forward, X = fused forward+backward, B = recompute+backward, with layer counts; "
            "'2 largest stages' counts parameters, plus gradients for X/B stages"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--engine", choices=["roundpipe_core", "plain", "published"], default="roundpipe_core"
    )
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--num-microbatch",
        type=int,
        default=None,
        help="RoundPipe microbatches (default: engine's)",
    )
    ap.add_argument(
        "--plan",
        choices=["auto", "default", "uniform"],
        default="auto",
        help="roundpipe_core: auto = plan from measured times after warm-up; "
        "uniform = --stages stages of equal layer counts (forced multi-stage)",
    )
    ap.add_argument("--stages", type=int, default=4, help="stages of --plan uniform")
    ap.add_argument(
        "--devices",
        type=int,
        default=None,
        help="roundpipe_core workers, spread over the visible GPUs (default: one per GPU)",
    )
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 28)")
    ap.add_argument(
        "--check-memory",
        action="store_true",
        help="roundpipe_core: check the peak GPU memory against the per-worker stage bound",
    )
    ap.add_argument("--label", default=None, help="name of the result row (default: --engine)")
    ap.add_argument("--pin-model", choices=["alloc", "register", "off"], default="alloc")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny model, for a smoke test (runs on CPU too)"
    )
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument("--table", help="print the table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print_table(args.table)
        return 0
    if args.tiny and args.seq == 2048:
        args.seq = 32
    result = run_engine(args)
    line = json.dumps(result)
    print("RESULT", line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return 0 if result.get("status") in ("ok", "oom", "unavailable") else 1


if __name__ == "__main__":
    sys.exit(main())
