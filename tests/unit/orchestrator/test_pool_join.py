"""WorkerPool: a joining worker is scraped before it becomes routable, and telemetry diffs its counters from there.

The race this guards against: `kvyard up` starts the engines before the frontend, so each worker is older
than the frontend's telemetry aggregator; if the first metrics the aggregator saw came from a scrape taken
after the first burst of requests, that burst's prefix-cache hits were the baseline and never counted
(the dashboard's pool hit rate then stayed empty).
"""

from __future__ import annotations

import asyncio

from orchestrator.engine_client import EngineUnreachableError
from orchestrator.pool import WorkerPool
from orchestrator.telemetry_recorder import FrontendTelemetry
from router import Router
from workers.discovery import InMemoryDiscovery
from planner.telemetry import InMemoryTelemetryStore, PoolKey, merge_buckets
from workers.types import WorkerInfo


def metrics(queries: int, hits: int) -> str:
    return (f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n')


async def test_join_scrape_is_the_baseline_of_the_hit_rate() -> None:
    counters = {"q": 1000, "h": 100}  # the engine's history before this frontend existed
    scrapes: list[int] = []

    class Engine:  # the pool's engine client, answering /metrics
        async def fetch(self, method: str, url: str, timeout_s: float) -> tuple[int, bytes]:
            scrapes.append(counters["q"])
            return 200, metrics(counters["q"], counters["h"]).encode()

        async def close(self) -> None:
            pass

    disc = InMemoryDiscovery()
    await disc.register(WorkerInfo(worker_id="w0", model="m", backend="vllm", url="http://127.0.0.1:9", started_at=0.0), 60)
    pool = WorkerPool(disc, Router("kv"))
    await pool._client.close()
    pool._client = Engine()
    joined: list[str] = []
    pool.on_worker_joined.append(lambda live: joined.append(live.info.worker_id))
    telemetry = FrontendTelemetry.for_pool(InMemoryTelemetryStore(), pool)

    await pool.refresh()
    assert joined == ["w0"] and scrapes == [1000]  # scraped once, before it was routable
    assert pool.workers["w0"].metrics is not None

    counters.update(q=1400, h=400)  # a burst: 400 queried tokens, 300 of them hits, before any flush
    await pool.scrape()
    telemetry.aggregator.record_workers([(w.info, w.metrics) for w in pool.workers.values()])
    (bucket,) = telemetry.aggregator.drain().buckets.values()
    assert (bucket.kv_hit_tokens, bucket.kv_query_tokens) == (300, 400)
    stats = merge_buckets(PoolKey("m", "both"), [bucket], window_s=10)
    assert stats.kv_hit_rate == 0.75
    await pool.close()


async def test_a_join_scrape_that_fails_still_adds_the_worker() -> None:
    disc = InMemoryDiscovery()
    await disc.register(WorkerInfo(worker_id="w0", model="m", backend="vllm", url="http://127.0.0.1:9"), 60)
    pool = WorkerPool(disc, Router("kv"))
    class Refused:
        async def fetch(self, method: str, url: str, timeout_s: float) -> tuple[int, bytes]:
            raise EngineUnreachableError("ClientConnectorError: refused")

        async def close(self) -> None:
            pass

    await pool._client.close()
    pool._client = Refused()
    await pool.refresh()
    assert list(pool.workers) == ["w0"] and pool.workers["w0"].metrics is None
    await pool.close()


async def test_concurrent_refreshes_join_a_worker_once() -> None:
    """A caller's refresh beside the pool's own: the new worker is scraped and joined once, and the LiveWorker that
    stays is the one the join scraped (before, the later refresh replaced it)."""
    scrapes: list[str] = []

    class SlowEngine:
        async def fetch(self, method: str, url: str, timeout_s: float) -> tuple[int, bytes]:
            scrapes.append(url)
            await asyncio.sleep(0.05)
            return 200, metrics(1, 0).encode()

        async def close(self) -> None:
            pass

    disc = InMemoryDiscovery()
    await disc.register(WorkerInfo(worker_id="w0", model="m", backend="vllm", url="http://127.0.0.1:9"), 60)
    pool = WorkerPool(disc, Router("kv"))
    await pool._client.close()
    pool._client = SlowEngine()
    joined: list[str] = []
    pool.on_worker_joined.append(lambda live: joined.append(live.info.worker_id))
    await asyncio.gather(pool.refresh(), pool.refresh())
    assert joined == ["w0"] and len(scrapes) == 1
    await pool.close()
