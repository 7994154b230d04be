"""Aggregator: requests and worker samples land in the right pool bucket; drain/restore."""

from __future__ import annotations

import pytest

from planner.telemetry import PoolKey, TelemetryAggregator, TelemetrySchema, merge_buckets
from workers.types import EngineMetrics, WorkerInfo, WorkerRole


def winfo(wid: str, model: str = "m", role: WorkerRole = WorkerRole.BOTH, started_at: float = 0.0) -> WorkerInfo:
    """A worker that was already running (started long before the aggregator) unless `started_at` says otherwise."""
    return WorkerInfo(worker_id=wid, model=model, backend="sim", url="http://127.0.0.1:9", role=role, started_at=started_at)


def test_request_goes_to_its_pool_and_bucket():
    agg = TelemetryAggregator(TelemetrySchema(bucket_s=10))
    agg.record_request("m", "decode", ttft_s=0.2, duration_s=1.2, isl=100, osl=11, now=1005.0)
    agg.record_request("m", "decode", ttft_s=0.4, duration_s=0.4, isl=50, osl=1, now=1009.9)
    agg.record_request("m", "decode", ttft_s=None, duration_s=0.1, isl=10, osl=0, ok=False, now=1010.0)
    batch = agg.drain()
    assert set(batch.buckets) == {(PoolKey("m", "decode"), 1000.0), (PoolKey("m", "decode"), 1010.0)}
    b = batch.buckets[(PoolKey("m", "decode"), 1000.0)]
    assert (b.requests, b.errors, b.isl_sum, b.osl_sum) == (2, 0, 150, 12)
    assert b.ttft.total == 2
    assert b.itl.total == 10 and b.itl.sum == pytest.approx(1000.0)  # 10 gaps of 100 ms
    assert batch.buckets[(PoolKey("m", "decode"), 1010.0)].errors == 1
    assert agg.drain().is_empty()


def test_worker_samples_give_pool_gauges_and_prefix_hits():
    agg = TelemetryAggregator(TelemetrySchema(bucket_s=10))
    a, b = winfo("a"), winfo("b")
    agg.record_workers([(a, EngineMetrics(num_requests_waiting=2, kv_cache_usage=0.5, prefix_cache_queries=100, prefix_cache_hits=10)),
                        (b, EngineMetrics(num_requests_waiting=4, kv_cache_usage=0.3))], now=100.0)
    agg.record_workers([(a, EngineMetrics(num_requests_waiting=0, kv_cache_usage=0.1, prefix_cache_queries=300, prefix_cache_hits=110)),
                        (b, None)], now=101.0)
    batch = agg.drain()
    bucket = batch.buckets[(PoolKey("m", "both"), 100.0)]
    stats = merge_buckets(PoolKey("m", "both"), [bucket], window_s=10)
    assert bucket.gauge_samples == 2
    assert stats.queue_depth == pytest.approx((6 + 0) / 2)
    assert stats.kv_usage == pytest.approx((0.4 + 0.1) / 2)
    assert stats.workers == pytest.approx(1.5)
    assert stats.kv_hit_rate == pytest.approx(100 / 200)  # deltas only, first sample is the baseline
    assert {w.worker_id for w in batch.workers} == {"a", "b"}


def test_worker_started_after_us_counts_from_zero():
    """A worker that started while we watched had zero counters then: a first scrape after a burst keeps its hits."""
    import time

    agg = TelemetryAggregator()
    fresh, old = winfo("fresh", started_at=time.time() + 1), winfo("old", started_at=0.0)
    agg.record_workers([(fresh, EngineMetrics(prefix_cache_queries=200, prefix_cache_hits=150)),
                        (old, EngineMetrics(prefix_cache_queries=9000, prefix_cache_hits=9000))], now=0.0)
    (bucket,) = agg.drain().buckets.values()
    assert (bucket.kv_hit_tokens, bucket.kv_query_tokens) == (150, 200)  # the old worker's history is a baseline


def test_counter_reset_counts_from_zero():
    agg = TelemetryAggregator()
    a = winfo("a")
    agg.record_workers([(a, EngineMetrics(prefix_cache_queries=1000, prefix_cache_hits=500))], now=0.0)
    agg.record_workers([(a, EngineMetrics(prefix_cache_queries=40, prefix_cache_hits=10))], now=1.0)
    (bucket,) = agg.drain().buckets.values()
    assert (bucket.kv_hit_tokens, bucket.kv_query_tokens) == (10, 40)


def test_restore_merges_and_bounds():
    agg = TelemetryAggregator(TelemetrySchema(bucket_s=1), max_pending_buckets=3)
    for t in range(3):
        agg.record_request("m", ttft_s=0.1, duration_s=0.1, isl=1, osl=1, now=float(t))
    unsent = agg.drain()
    agg.record_request("m", ttft_s=0.1, duration_s=0.1, isl=1, osl=1, now=2.0)
    agg.record_request("m", ttft_s=0.1, duration_s=0.1, isl=1, osl=1, now=3.0)
    agg.restore(unsent)
    batch = agg.drain()
    assert sorted(k[1] for k in batch.buckets) == [1.0, 2.0, 3.0]  # oldest dropped past the bound
    assert agg.dropped_buckets == 1
    assert batch.buckets[(PoolKey("m"), 2.0)].requests == 2


def test_arrivals_are_counted_apart_from_finishes():
    agg = TelemetryAggregator(TelemetrySchema(bucket_s=10))
    for _ in range(4):
        agg.record_arrival("m", "prefill", now=5.0)
    agg.record_request("m", "prefill", ttft_s=0.1, duration_s=0.1, isl=10, osl=1, now=6.0)
    (b,) = agg.drain().buckets.values()
    stats = merge_buckets(PoolKey("m", "prefill"), [b], window_s=10)
    assert (stats.arrival_rate, stats.request_rate) == (0.4, 0.1)


def test_prompt_length_spread():
    agg = TelemetryAggregator(TelemetrySchema(bucket_s=10))
    for isl in (100, 300):
        agg.record_request("m", ttft_s=0.1, duration_s=0.1, isl=isl, osl=1, now=0.0)
    (b,) = agg.drain().buckets.values()
    assert merge_buckets(PoolKey("m"), [b], 10).isl_cv2 == pytest.approx(0.25)  # std 100 / mean 200, squared
