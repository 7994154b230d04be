"""Shared planner fixtures: a small hand-made perf model and observation builders."""

from __future__ import annotations

import pytest

from planner.perf_model import PerfModel
from planner.types import Observation, PoolObservation
from planner.telemetry.schema import PoolKey, PoolStats
from planner.telemetry.targets import Targets, VersionedTargets


def toy_perf() -> PerfModel:
    """Prefill: 10 ms + 0.01 ms/token (100 ms at 9000 tokens). Decode: ITL = 5 + 20·u ms at any context;
    100,000 KV tokens."""
    isl = [0, 1000, 9000, 20000]
    ttft = [10 + 0.01 * x for x in isl]
    pts = [(u, c, 5 + 20 * u) for c in (1000.0, 10000.0) for u in (0.0, 0.5, 1.0)]
    return PerfModel("toy", isl, ttft, pts, max_kv_tokens=100_000)


@pytest.fixture
def perf() -> PerfModel:
    return toy_perf()


def stats(pool: PoolKey, rate: float = 10.0, isl: float = 1000, osl: float = 100, hit: float | None = 0.0,
          ttft_p90: float | None = 100.0, itl_p90: float | None = 10.0, window: float = 60.0,
          cv2: float | None = None) -> PoolStats:
    return PoolStats(pool=pool, window_s=window, requests=int(rate * window), request_rate=rate, arrival_rate=rate,
                     avg_isl=isl, isl_cv2=cv2, avg_osl=osl, tokens_per_s=rate * osl, kv_hit_rate=hit,
                     ttft_p50_ms=ttft_p90, ttft_p90_ms=ttft_p90, ttft_p99_ms=ttft_p90,
                     itl_p50_ms=itl_p90, itl_p90_ms=itl_p90, itl_p99_ms=itl_p90,
                     queue_depth=0.0, running=0.0, kv_usage=0.3, workers=1.0)


def targets(*pools: dict, gpu_budget: int | None = None, version: int = 1) -> VersionedTargets:
    return VersionedTargets(version=version, updated_at=0.0, targets=Targets(pools=list(pools), gpu_budget=gpu_budget))


def observe(vt: VersionedTargets | None, *pools: PoolObservation, ok: bool = True) -> Observation:
    return Observation(targets=vt, pools={p.pool: p for p in pools}, telemetry_ok=ok)
