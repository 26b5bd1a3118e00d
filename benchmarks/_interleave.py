"""Side-by-side timing: run every variant once per round, in the same process, and
report each variant's median and spread over the rounds.

Interleaving (A, B, C, A, B, C, ...) makes machine noise (other processes, frequency
changes, a shared CI box) hit every variant alike, so the ratios between medians
are meaningful even when the absolute times are not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Timing", "interleave", "format_table"]


@dataclass
class Timing:
    """Per-round seconds of one variant."""

    name: str
    seconds: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1000.0

    @property
    def spread_ms(self) -> tuple[float, float]:
        """(25th, 75th) percentile in ms; equal to the median with fewer than 4 rounds."""
        if len(self.seconds) < 4:
            return self.median_ms, self.median_ms
        q = statistics.quantiles(self.seconds, n=4)
        return q[0] * 1000.0, q[2] * 1000.0


def interleave(
    variants: dict[str, Callable[[], object]], rounds: int, warmup: int = 2
) -> dict[str, Timing]:
    """Time each variant once per round, rounds times, after ``warmup`` untimed rounds.

    The order within a round rotates so no variant always runs right after the same
    neighbour (a variant that leaves caches cold or a thread busy would otherwise
    always penalise the same follower).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    out = {name: Timing(name, []) for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            variants[name]()
            out[name].seconds.append(time.perf_counter() - t0)
    return out


def format_table(timings: dict[str, Timing], baselines: list[str]) -> str:
    """A table of median, interquartile spread and the ratio of medians to each baseline."""
    width = max(len(n) for n in timings) + 2
    head = f"{'variant':<{width}}{'median ms':>11}{'p25..p75 ms':>17}"
    head += "".join(f"{'/ ' + b:>{max(12, len(b) + 4)}}" for b in baselines)
    lines = [head]
    for name, t in timings.items():
        lo, hi = t.spread_ms
        row = f"{name:<{width}}{t.median_ms:>11.1f}{f'{lo:.1f}..{hi:.1f}':>17}"
        for b in baselines:
            row += f"{t.median_ms / timings[b].median_ms:>{max(12, len(b) + 4)}.2f}"
        lines.append(row)
    return "\n".join(lines)
