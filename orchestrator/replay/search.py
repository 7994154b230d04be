"""`--find-min-workers`: the smallest fixed fleet that meets the SLO on a workload, found by replaying it.

A fleet meets the SLO when, over the whole run, TTFT p90 <= slo_ttft_p90_ms and the p90 of every token gap <=
slo_itl_p90_ms, and no request was rejected. Aggregated: the smallest N in [1, max_workers]. P/D: the smallest
prefill count with `max_workers` decode workers, then the smallest decode count with that prefill count (TTFT is
mostly the prefill pool's, ITL the decode pool's). Each search doubles from 1 until a fleet meets the SLO, then
bisects between the last miss and the first hit (it assumes more workers never hurt). Every probe is a full
replay, recorded with its figures.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.replay.config import ReplayConfig
from orchestrator.replay.results import summarize
from orchestrator.replay.runner import Replay
from orchestrator.replay.workload import Workload

__all__ = ["find_min_workers", "meets_slo"]


def meets_slo(summary: dict, ttft_ms: float | None, itl_ms: float | None) -> bool:
    t90, i90 = summary["ttft_ms"]["p90"], summary["itl_ms"]["p90"]
    if summary["rejected"] or summary["unfinished"]:
        return False
    return (ttft_ms is None or (t90 is not None and t90 <= ttft_ms)) and (itl_ms is None or (i90 is not None and i90 <= itl_ms))


def _smallest(ok: Callable[[int], bool], hi_max: int) -> int | None:
    last_miss, n = 0, 1
    while n <= hi_max:
        if ok(n):
            break
        last_miss, n = n, min(hi_max, n * 2) if n < hi_max else hi_max + 1
    else:
        return None
    lo, hi = last_miss + 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def find_min_workers(cfg: ReplayConfig, workload: Workload, max_workers: int = 256,
                     on_probe: Callable[[dict], None] | None = None) -> dict:
    if cfg.slo_ttft_p90_ms is None and cfg.slo_itl_p90_ms is None:
        raise ValueError("--find-min-workers needs --slo-ttft-p90 and/or --slo-itl-p90")
    probes: list[dict] = []
    cache: dict[tuple[int, int], bool] = {}

    def ok(workers: int = 0, prefill: int = 0, decode: int = 0) -> bool:
        key = (workers, prefill) if not cfg.disaggregated else (prefill, decode)
        if key in cache:
            return cache[key]
        c = cfg.model_copy(update={"workers": workers, "prefill": prefill, "decode": decode, "planner": None})
        r = Replay(c, workload).run()
        s = summarize(r.records, r.gaps, r.end_time)
        good = meets_slo(s, cfg.slo_ttft_p90_ms, cfg.slo_itl_p90_ms)
        probe = {"workers": workers, "prefill": prefill, "decode": decode, "ok": good, "ttft_p90_ms": s["ttft_ms"]["p90"],
                 "itl_p90_ms": s["itl_ms"]["p90"], "rejected": s["rejected"], "gpu_seconds": round(r.gpu_seconds(), 1),
                 "wall_s": round(r.wall_s, 2)}
        probes.append(probe)
        if on_probe is not None:
            on_probe(probe)
        cache[key] = good
        return good

    if cfg.disaggregated:
        p = _smallest(lambda n: ok(prefill=n, decode=max_workers), max_workers)
        d = _smallest(lambda n: ok(prefill=p, decode=n), max_workers) if p is not None else None
        found = None if p is None or d is None else {"prefill": p, "decode": d}
    else:
        n = _smallest(lambda n: ok(workers=n), max_workers)
        found = None if n is None else {"workers": n}
    return {"found": found, "max_workers": max_workers, "slo_ttft_p90_ms": cfg.slo_ttft_p90_ms,
            "slo_itl_p90_ms": cfg.slo_itl_p90_ms, "probes": probes}
