"""Contiguous partitions of layers under a stage-time cap and a stage-memory cap.
Packing greedily from the deepest layer is optimal for a fixed cap, so the fewest
stages under a cap is one pass of binary searches over prefix sums.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from itertools import accumulate

__all__ = ["Partitioner", "first_true", "prefix_sums", "with_slack"]


def prefix_sums(xs: Sequence[float]) -> list[float]:
    """``[0, x0, x0 + x1, ...]``."""
    return list(accumulate(xs, initial=0.0))


def with_slack(t: float) -> float:
    """``t`` plus a hair: caps are differences of prefix sums, and a cap equal to a
    segment's sum must admit that segment despite rounding."""
    return t + 1e-9 * abs(t) + 1e-12


def first_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """Smallest index in ``lo..hi`` where the monotone ``pred`` holds (``hi`` if none
    before it; the caller checks ``pred(hi)`` when that matters)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class Partitioner:
    """Layers 0..n-1 with a ``cost`` and a ``mem`` (default 0) each, summed per stage;
    packs stages from the end."""

    def __init__(self, cost: Sequence[float], mem: Sequence[float] | None = None) -> None:
        self.cost_prefix = prefix_sums(cost)
        self.mem_prefix = prefix_sums(
            [float(m) for m in mem] if mem is not None else [0.0] * len(cost)
        )
        self._sums: dict[int, list[float]] = {}

    def cut(self, j: int, cap: float, mem_cap: float) -> int:
        """Smallest i such that layers i..j-1 fit one stage (== j when not even one fits)."""
        p, q = self.cost_prefix, self.mem_prefix
        i = bisect.bisect_left(p, p[j] - with_slack(cap), 0, j)
        k = bisect.bisect_left(q, q[j] - mem_cap * (1 + 1e-12), 0, j)
        return max(i, k)

    def count(self, n: int, cap: float, mem_cap: float = math.inf) -> float:
        """Fewest stages covering layers 0..n-1 (``inf`` when a layer alone does not fit)."""
        p, q = self.cost_prefix, self.mem_prefix
        slack, mslack = with_slack(cap), mem_cap * (1 + 1e-12)
        left = bisect.bisect_left
        stages, j = 0, n
        while j > 0:
            i = left(p, p[j] - slack, 0, j)
            if mslack != math.inf:
                k = left(q, q[j] - mslack, 0, j)
                i = i if i > k else k
            if i >= j:
                return math.inf
            stages += 1
            j = i
        return stages

    def pack(self, n: int, cap: float, mem_cap: float = math.inf) -> list[range]:
        """The stages of :meth:`count`, deepest first."""
        out, j = [], n
        while j > 0:
            i = self.cut(j, cap, mem_cap)
            if i >= j:
                raise ValueError(f"no stage ending at layer {j - 1} fits the cap {cap!r}")
            out.append(range(i, j))
            j = i
        return out

    def segment_sums(self, n: int) -> list[float]:
        """Sorted distinct costs of every contiguous run of layers inside 0..n-1."""
        if n not in self._sums:
            p = self.cost_prefix
            self._sums[n] = sorted({p[j] - p[i] for i in range(n) for j in range(i + 1, n + 1)})
        return self._sums[n]

    def smallest_cap(
        self, n: int, k: float, hi: float, mem_cap: float = math.inf, rel_tol: float = 1e-13
    ) -> float:
        """The smallest cap (to ``rel_tol``) under which layers 0..n-1 pack into at most
        ``k`` stages, given such a cap ``hi``: bisection, then snapped to the slowest
        stage of that packing (a segment's exact cost)."""
        p = self.cost_prefix
        lo = (p[n] - p[0]) / k if k > 0 else 0.0  # the slowest stage is at least the mean
        lo = min(lo, hi) * (1 - 1e-12)
        for _ in range(200):
            if hi - lo <= rel_tol * hi:
                break
            mid = 0.5 * (lo + hi)
            if self.count(n, mid, mem_cap) <= k:
                hi = mid
            else:
                lo = mid
        return max(p[r.stop] - p[r.start] for r in self.pack(n, hi, mem_cap))

    def balanced(self, n: int, cap: float, mem_cap: float = math.inf) -> list[range]:
        """As few stages as under ``cap``, as even as that count allows (deepest first)."""
        if n == 0:
            return []
        best = self.smallest_cap(n, self.count(n, cap, mem_cap), cap, mem_cap)
        return self.pack(n, min(best, cap), mem_cap)
