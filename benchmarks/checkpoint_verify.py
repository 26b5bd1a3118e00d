"""What checking each tensor storage's CRC-32 costs when a checkpoint is loaded.

    python benchmarks/checkpoint_verify.py [--mb 100] [--rounds 7]

One process writes a checkpoint of about ``--mb`` megabytes (an fp32 ``state_dict`` of
16 tensors and an AdamW-like ``optimizer_states`` of twice that, as ``torch.save``
writes it: with a CRC-32 per record), then times, interleaved round by round
(``benchmarks/_interleave.py``), with the file in the page cache (a second load of the
same file, the case where the check's share is largest):

- ``load, mmap``: ``torch.load(mmap=True, weights_only=True)`` alone -- the baseline;
- ``load, mmap + copy``: the same, then every tensor copied into preallocated tensors
  (what restoring a model and optimizer does with the mapped file);
- ``verify``: :func:`roundpipe_core.checkpoint_file.verify_archive` alone;
- ``read_checkpoint + copy``: the checked load ``StreamingCheckpointIO`` runs, then the
  same copies -- against ``load, mmap + copy`` this is the check's cost on a resume.

The ratios are meaningful; the milliseconds depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _interleave import format_table, interleave  # noqa: E402

from roundpipe_core.checkpoint_file import read_checkpoint, verify_archive  # noqa: E402


def _checkpoint(mb: float) -> dict:
    n = int(mb * 2**20 / 4 / 3 / 16)  # elements per tensor: weights + two moments
    weights = {f"w{i}": torch.randn(n) for i in range(16)}
    moments = {i: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)} for i in range(16)}
    return {"state_dict": weights, "optimizer_states": [{"state": moments}]}


def _targets(ck: dict) -> list[torch.Tensor]:
    out = list(ck["state_dict"].values())
    for s in ck["optimizer_states"][0]["state"].values():
        out += [s["exp_avg"], s["exp_avg_sq"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.ckpt"
        ck = _checkpoint(args.mb)
        torch.save(ck, path)
        into = [torch.empty_like(t) for t in _targets(ck)]
        del ck
        size_mb = path.stat().st_size / 2**20

        def copy(loaded: dict) -> None:
            for dst, src in zip(into, _targets(loaded)):
                dst.copy_(src)

        variants = {
            "load, mmap": lambda: torch.load(path, mmap=True, weights_only=True),
            "load, mmap + copy": lambda: copy(torch.load(path, mmap=True, weights_only=True)),
            "verify": lambda: verify_archive(path),
            "read_checkpoint + copy": lambda: copy(read_checkpoint(path)),
        }
        timings = interleave(variants, rounds=args.rounds)
        print(f"checkpoint of {size_mb:.1f} MiB, {args.rounds} rounds, torch {torch.__version__}")
        print(format_table(timings, ["load, mmap + copy"]))
        verify_ms = timings["verify"].median_ms
        print(f"verify: {size_mb / (verify_ms / 1000):.0f} MiB/s")


if __name__ == "__main__":
    main()
