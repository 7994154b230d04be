"""The same contract for the in-memory and the Redis telemetry store (the Redis one on real Redis)."""

from __future__ import annotations

import time
import uuid

import pytest

from planner.telemetry import (
    InMemoryTelemetryStore,
    PoolKey,
    RedisTelemetryStore,
    TelemetryAggregator,
    TelemetrySchema,
    TelemetryUnavailableError,
    merge_buckets,
)
from workers.types import EngineMetrics, WorkerInfo, WorkerRole


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request):
    schema = TelemetrySchema(prefix=f"kvyard-test-{uuid.uuid4().hex[:8]}", bucket_s=10, retention_s=3600, worker_ttl_s=30, decisions_cap=5)
    if request.param == "memory":
        s = InMemoryTelemetryStore(schema)
    else:
        s = RedisTelemetryStore(request.getfixturevalue("redis_url"), schema)
    yield s
    await s.close()


def _batch(now: float, n: int = 3, model: str = "org/m:1", role: str = "decode"):
    agg = TelemetryAggregator(TelemetrySchema(bucket_s=10))
    for i in range(n):
        agg.record_arrival(model, role, now=now)
        agg.record_request(model, role, ttft_s=0.1 * (i + 1), duration_s=1.0, isl=100, osl=10, now=now)
    return agg.drain()


async def test_write_merges_deltas_into_buckets(store):
    now = time.time()
    await store.write(_batch(now, 3))
    await store.write(_batch(now, 2))
    got = await store.read_pool_buckets(now - 60, now + 60)
    pool = PoolKey("org/m:1", "decode")
    assert list(got) == [pool]
    (b,) = got[pool]
    assert b.arrivals == 5 and b.requests == 5 and b.isl_sum == 500 and b.ttft.total == 5 and b.itl.total == 45
    stats = merge_buckets(pool, got[pool], 10)
    assert stats.ttft_p90_ms == pytest.approx(300, rel=0.16)


async def test_read_window_and_order(store):
    now = store.schema.bucket_start(time.time())
    for dt in (-40, -20, 0):
        await store.write(_batch(now + dt, 1))
    got = await store.read_pool_buckets(now - 30, now + 10)
    assert [b.start for b in got[PoolKey("org/m:1", "decode")]] == [now - 20, now]


async def test_pools_are_separate(store):
    now = time.time()
    await store.write(_batch(now, 1, role="prefill"))
    await store.write(_batch(now, 2, role="decode"))
    got = await store.read_pool_buckets(now - 60, now + 60)
    assert {p: bs[0].requests for p, bs in got.items()} == {PoolKey("org/m:1", "prefill"): 1, PoolKey("org/m:1", "decode"): 2}


async def test_worker_samples_latest_and_stale(store):
    agg = TelemetryAggregator()
    info = WorkerInfo(worker_id="w1", model="m", backend="sim", url="http://x", role=WorkerRole.PREFILL)
    now = time.time()
    agg.record_workers([(info, EngineMetrics(num_requests_waiting=3, kv_cache_usage=0.25))], now=now)
    await store.write(agg.drain())
    (w,) = await store.read_workers(now)
    assert (w.worker_id, w.model, w.role, w.metrics.num_requests_waiting, w.metrics.kv_cache_usage) == ("w1", "m", "prefill", 3, 0.25)
    assert await store.read_workers(now + 31) == []


async def test_decisions_capped_newest_first(store):
    for i in range(7):
        await store.append_decision({"tick": i, "reason": "x"})
    got = await store.recent_decisions(10)
    assert [d["tick"] for d in got] == [6, 5, 4, 3, 2]
    assert [d["tick"] for d in await store.recent_decisions(2)] == [6, 5]


async def test_empty_reads(store):
    assert await store.read_pool_buckets(0, time.time()) == {}
    assert await store.read_workers() == []
    assert await store.recent_decisions() == []


@pytest.mark.redis
async def test_redis_bucket_keys_have_a_ttl_and_malformed_entries_are_skipped(redis_url):
    import redis.asyncio as aioredis

    schema = TelemetrySchema(prefix=f"kvyard-test-{uuid.uuid4().hex[:8]}", retention_s=120)
    store = RedisTelemetryStore(redis_url, schema)
    r = aioredis.from_url(redis_url)
    now = time.time()
    try:
        await store.write(_batch(now, 1))
        key = schema.bucket_key(PoolKey("org/m:1", "decode"), schema.bucket_start(now))
        assert 0 < await r.ttl(key) <= 120
        # corrupt it: one bad field and one bad pool id; the reader logs and skips, never crashes
        await r.hset(key, "n", "not-a-number")
        await r.zadd(schema.pools_key, {"no-role-here": now})
        await r.hset(schema.worker_key("bad"), mapping={"model": "m"})
        await r.zadd(schema.workers_key, {"bad": now})
        await r.lpush(schema.decisions_key, "{not json")
        assert await store.read_pool_buckets(now - 60, now + 60) == {}
        assert await store.read_workers(now) == []
        assert await store.recent_decisions() == []
    finally:
        await r.aclose()
        await store.close()


@pytest.mark.redis
async def test_redis_down_raises_our_error():
    store = RedisTelemetryStore("redis://127.0.0.1:1/0", timeout_s=0.2)
    with pytest.raises(TelemetryUnavailableError):
        await store.write(_batch(time.time(), 1))
    with pytest.raises(TelemetryUnavailableError):
        await store.read_pool_buckets(0, 1)
    await store.close()
