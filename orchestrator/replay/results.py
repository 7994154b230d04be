"""What a replay measured, and its summary.

Per request (RequestRecord): arrival, first token, last token, finish, tokens, cached prompt tokens, workers.
    TTFT = first token - arrival;  E2E = finish - arrival;  TPOT = (last - first) / (tokens - 1)
Per token gap (ITL): a histogram of 10 µs buckets per minute of the clock, so ITL percentiles are over every gap of
every request (as Dynamo's replay reports them), both for the run and per minute (to 0.01 ms).
Per minute (by the minute a request's first token came): TTFT p90; ITL p90 over the gaps that ended in that
minute. A minute is within the SLA when both are within their targets (a minute with no data is within it).
Hit rate: prompt tokens served from the engines' prefix caches over all prompt tokens (each request counted
once, on its first admission, as vLLM's counters do); against the fleet bound (orchestrator/replay/bound.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["GapHistogram", "RequestRecord", "percentile", "summarize"]



@dataclass(slots=True, eq=False)
class RequestRecord:
    index: int
    arrival: float
    isl: int
    osl: int
    worker: str = ""  # the worker that produced its tokens (decode worker in P/D)
    prefill_worker: str = ""  # P/D: where it was prefilled ("" when locally)
    admitted: float | None = None  # first admitted by its (decode or aggregated) engine's scheduler
    first: float | None = None
    last: float | None = None
    finish: float | None = None
    tokens: int = 0
    cached: int = 0  # prompt tokens its (decode or aggregated) engine found cached
    status: str = "pending"  # ok | rejected
    disagg: str = ""  # P/D decision reason

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.tokens <= 1 or self.first is None or self.last is None:
            return None
        return (self.last - self.first) / (self.tokens - 1)


class GapHistogram:
    """Token gaps in buckets of RES ms (key = floor(gap_ms / RES)), per minute; a quantile is its bucket's middle."""

    RES = 0.01
    SCALE = 1.0 / RES
    __slots__ = ("minutes",)

    def __init__(self) -> None:
        self.minutes: dict[int, dict[int, int]] = {}

    def bucket_of(self, minute: int) -> dict[int, int]:
        h = self.minutes.get(minute)
        if h is None:
            h = self.minutes[minute] = {}
        return h

    @classmethod
    def key(cls, gap_ms: float) -> int:
        return int(gap_ms * cls.SCALE)

    @classmethod
    def quantiles(cls, counts: dict[int, int], qs: tuple[float, ...]) -> list[float | None]:
        total = sum(counts.values())
        if not total:
            return [None] * len(qs)
        keys = sorted(counts)
        out: list[float | None] = []
        for q in qs:
            target, acc = q * total, 0
            for k in keys:
                acc += counts[k]
                if acc >= target:
                    out.append((k + 0.5) * cls.RES)
                    break
        return out

    def total(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for h in self.minutes.values():
            for k, c in h.items():
                out[k] = out.get(k, 0) + c
        return out

    def mean(self) -> float | None:
        tot = self.total()
        n = sum(tot.values())
        return sum((k + 0.5) * self.RES * c for k, c in tot.items()) / n if n else None


def percentile(values, q: float) -> float | None:
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return float(np.percentile(arr, q)) if arr.size else None


def _ms(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x * 1000.0, nd)


def summarize(records: list[RequestRecord], gaps: GapHistogram, end_time: float, *, slo_ttft_ms: float | None = None,
              slo_itl_ms: float | None = None) -> dict:
    """Latency percentiles (ms), throughput, and the per-minute SLA table."""
    done = [r for r in records if r.status == "ok"]
    ttft = np.array([r.ttft for r in done if r.ttft is not None], dtype=float)
    e2e = np.array([r.e2e for r in done if r.e2e is not None], dtype=float)
    tpot = np.array([r.tpot for r in done if r.tpot is not None], dtype=float)
    qs = (0.5, 0.9, 0.99)
    itl = GapHistogram.quantiles(gaps.total(), qs)
    span = max(end_time, 1e-9)
    out_tokens = sum(r.tokens for r in done)

    def pct(a: np.ndarray) -> dict:
        if not a.size:
            return {"p50": None, "p90": None, "p99": None, "mean": None}
        return {"p50": _ms(float(np.percentile(a, 50))), "p90": _ms(float(np.percentile(a, 90))),
                "p99": _ms(float(np.percentile(a, 99))), "mean": _ms(float(a.mean()))}

    mean_itl = gaps.mean()
    summary = {
        "requests": len(records), "completed": len(done), "rejected": sum(r.status == "rejected" for r in records),
        "unfinished": sum(r.status == "pending" for r in records),
        "ttft_ms": pct(ttft), "e2e_ms": pct(e2e), "tpot_ms": pct(tpot),
        # where the TTFT went, as the engines' histograms split it: waiting for the scheduler, then its prefill steps
        # (P/D: the wait runs until the decode engine admits the request, so it holds the remote prefill and transfer)
        "queue_ms": pct(np.array([r.admitted - r.arrival for r in done if r.admitted is not None], dtype=float)),
        "prefill_ms": pct(np.array([r.first - r.admitted for r in done if r.admitted is not None and r.first is not None],
                                   dtype=float)),
        "itl_ms": {"p50": None if itl[0] is None else round(itl[0], 3), "p90": None if itl[1] is None else round(itl[1], 3),
                   "p99": None if itl[2] is None else round(itl[2], 3), "mean": None if mean_itl is None else round(mean_itl, 3)},
        "duration_s": round(end_time, 3), "req_per_s": round(len(done) / span, 4), "output_tok_per_s": round(out_tokens / span, 2),
        "input_tok_per_s": round(sum(r.isl for r in done) / span, 2),
    }
    summary["minutes"] = minutes_table(done, gaps, end_time, slo_ttft_ms, slo_itl_ms)
    if slo_ttft_ms is not None or slo_itl_ms is not None:
        m = summary["minutes"]
        summary["minutes_within_sla"] = sum(row["ok"] for row in m)
        summary["minutes_total"] = len(m)
    return summary


def minutes_table(done: list[RequestRecord], gaps: GapHistogram, end_time: float, slo_ttft_ms: float | None,
                  slo_itl_ms: float | None) -> list[dict]:
    n_min = max(1, int(math.ceil(end_time / 60.0 - 1e-9)))
    ttfts: list[list[float]] = [[] for _ in range(n_min)]
    for r in done:
        if r.first is not None:
            ttfts[min(int(r.first // 60.0), n_min - 1)].append(r.first - r.arrival)
    rows = []
    for m in range(n_min):
        t90 = float(np.percentile(ttfts[m], 90)) * 1000.0 if ttfts[m] else None
        h = gaps.minutes.get(m)
        i90 = GapHistogram.quantiles(h, (0.9,))[0] if h else None
        ok = (slo_ttft_ms is None or t90 is None or t90 <= slo_ttft_ms) and (slo_itl_ms is None or i90 is None or i90 <= slo_itl_ms)
        rows.append({"minute": m, "requests": len(ttfts[m]), "ttft_p90_ms": None if t90 is None else round(t90, 1),
                     "itl_p90_ms": None if i90 is None else round(i90, 3), "ok": ok})
    return rows
