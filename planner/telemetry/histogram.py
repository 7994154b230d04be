"""Mergeable latency histograms with fixed, log-spaced buckets (so any two merge by adding counts).

Edges (milliseconds): e_k = LO · G^k for k = 0..K-1, with G = 1.15, so a bucket is 15 % wide and a
quantile read from it (linear interpolation inside the bucket) is within about ±7 % of the truth.
    TTFT_EDGES_MS: 1 ms .. ~120 s   (K = 85)
    ITL_EDGES_MS:  0.25 ms .. ~5 s  (K = 72)
Bucket index i counts values v with e_{i-1} < v <= e_i; index 0 is v <= e_0 and index K is the
overflow (v > e_{K-1}). Counts are kept sparse ({index: count}), which is also how they are stored.

Quantile q (0 < q <= 1): the smallest bucket whose cumulative count reaches q·N, interpolated
linearly between its edges by the rank inside it; the overflow bucket reports e_{K-1}.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

__all__ = ["Histogram", "TTFT_EDGES_MS", "ITL_EDGES_MS", "log_edges"]


def log_edges(lo: float, hi: float, growth: float = 1.15) -> tuple[float, ...]:
    """Edges lo, lo·g, lo·g², ... up to the first one >= hi."""
    n = int(math.ceil(math.log(hi / lo) / math.log(growth))) + 1
    return tuple(round(lo * growth**k, 6) for k in range(n))


TTFT_EDGES_MS = log_edges(1.0, 120_000.0)
ITL_EDGES_MS = log_edges(0.25, 5_000.0)


@dataclass(slots=True)
class Histogram:
    edges: tuple[float, ...]
    counts: dict[int, int] = field(default_factory=dict)
    total: int = 0
    sum: float = 0.0

    def observe(self, value: float, weight: int = 1) -> None:
        """Add `weight` observations of `value` (same unit as the edges)."""
        if weight <= 0 or not math.isfinite(value):
            return
        i = bisect_left(self.edges, value)
        self.counts[i] = self.counts.get(i, 0) + weight
        self.total += weight
        self.sum += value * weight

    def merge(self, other: Histogram) -> None:
        if other.edges is not self.edges and other.edges != self.edges:
            raise ValueError("cannot merge histograms with different edges")
        for i, c in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + c
        self.total += other.total
        self.sum += other.sum

    @property
    def mean(self) -> float | None:
        return self.sum / self.total if self.total else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile (e.g. 0.9 for p90), or None when empty."""
        if self.total <= 0:
            return None
        rank = max(min(q, 1.0), 0.0) * self.total
        seen = 0
        k = len(self.edges)
        for i in sorted(self.counts):
            c = self.counts[i]
            if c <= 0:
                continue
            if seen + c >= rank:
                if i >= k:
                    return self.edges[-1]
                lo = 0.0 if i == 0 else self.edges[i - 1]
                hi = self.edges[i]
                return lo + (hi - lo) * ((rank - seen) / c)
            seen += c
        return self.edges[-1]

    def copy(self) -> Histogram:
        return Histogram(self.edges, dict(self.counts), self.total, self.sum)
