"""Prometheus histograms between two scrapes: count, mean and quantiles of what happened in between.

A benchmark scrapes `/metrics` at the start and at the end of its steady state; `hist_delta(before,
after, name)` subtracts the cumulative buckets (summed over every label set, e.g. all models or all
engines' texts concatenated) and reads quantiles off the difference by linear interpolation inside
the bucket, as Prometheus's histogram_quantile does. Used by the soak to tell where a request's
time to first token went (frontend admission, the frontend's own TTFT, each engine's queue and TTFT).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["hist_delta", "parse_histogram"]


def parse_histogram(text: str, name: str) -> tuple[dict[float, float], float, float]:
    """Cumulative buckets (upper bound -> count), sum and count of histogram `name`, summed over label sets."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == name + "_sum":
                total += s.value
            elif s.name == name + "_count":
                count += s.value
    return buckets, total, count


def _quantile(q: float, bounds: list[float], cum: list[float]) -> float | None:
    n = cum[-1] if cum else 0.0
    if n <= 0:
        return None
    rank = q * n
    lo_bound, lo_cum = 0.0, 0.0
    for b, c in zip(bounds, cum):
        if c >= rank:
            if b == float("inf"):
                return lo_bound  # past the last finite bucket: its bound is all that is known
            return lo_bound + (b - lo_bound) * ((rank - lo_cum) / (c - lo_cum) if c > lo_cum else 1.0)
        lo_bound, lo_cum = b, c
    return lo_bound


def hist_delta(before: str, after: str, name: str, quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict:
    """What histogram `name` recorded between the two scrapes: n, mean and the given quantiles (seconds or units)."""
    b0, s0, n0 = parse_histogram(before, name)
    b1, s1, n1 = parse_histogram(after, name)
    bounds = sorted(b1)
    cum = [b1[b] - b0.get(b, 0.0) for b in bounds]
    n = n1 - n0
    out: dict = {"n": int(n), "mean": (s1 - s0) / n if n > 0 else None}
    for q in quantiles:
        v = _quantile(q, bounds, cum)
        out[f"p{round(q * 100)}"] = round(v, 4) if v is not None else None
    if out["mean"] is not None:
        out["mean"] = round(out["mean"], 4)
    return out
