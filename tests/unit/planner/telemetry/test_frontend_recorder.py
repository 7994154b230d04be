"""orchestrator/telemetry_recorder.py: hooks record in memory; one flush writes the pool bucket and
the worker samples to the store."""

from __future__ import annotations

import time
from types import SimpleNamespace

from orchestrator.telemetry_recorder import FrontendTelemetry, make_telemetry_store
from planner.telemetry import InMemoryTelemetryStore, PoolKey, RedisTelemetryStore, merge_buckets
from workers.types import EngineMetrics, WorkerInfo, WorkerRole


async def test_hooks_then_flush():
    store = make_telemetry_store(None)
    assert isinstance(store, InMemoryTelemetryStore)
    info = WorkerInfo(worker_id="w", model="m", backend="sim", url="http://x", role=WorkerRole.BOTH)
    pool = SimpleNamespace(workers={"w": SimpleNamespace(info=info, metrics=EngineMetrics(num_requests_waiting=2, kv_cache_usage=0.4))},
                           on_worker_joined=[])
    tel = FrontendTelemetry.for_pool(store, pool)
    for _ in range(3):
        tel.on_arrival("m")
        tel.on_finish("m", ttft_s=0.1, duration_s=1.0, isl=50, osl=10)
    assert await store.read_pool_buckets(0, time.time() + 10) == {}  # nothing written before a flush
    await tel.close()  # final flush
    got = await store.read_pool_buckets(time.time() - 60, time.time() + 10)
    stats = merge_buckets(PoolKey("m"), got[PoolKey("m")], 10)
    assert (stats.requests, stats.queue_depth, stats.kv_usage) == (3, 2, 0.4)
    assert [w.worker_id for w in await store.read_workers()] == ["w"]


def test_redis_store_when_configured():
    assert isinstance(make_telemetry_store("redis://127.0.0.1:6379/0", prefix="x"), RedisTelemetryStore)
