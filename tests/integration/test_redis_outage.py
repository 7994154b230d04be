"""Redis outage and restart under traffic, on a private redis-server (never the shared one).

A real cluster (`kvyard worker` sim processes and a `kvyard frontend` process) on a private,
non-persistent Redis, with streaming requests running throughout:
  - Redis killed for longer than the lease ttl: every request still completes; the frontend keeps
    routing to the workers it knew; the workers keep serving (lease renewals fail and are retried);
    telemetry recorded during the outage reaches Redis once it is back; workers re-register.
  - Redis restarted at once (it comes back empty): the frontend never loses its fleet, although the
    registry is empty until each worker's next renewal (the discovery's reset grace).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from orchestrator.testing.procs import KvyardCluster, RedisServer
from planner.telemetry.redis_store import RedisTelemetryStore
from planner.telemetry.schema import TelemetrySchema

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MODEL = "simmodel"


class Traffic:
    """`parallel` loops of streaming completions; each request has a 30 s deadline (normal: well under 1 s)."""

    def __init__(self, url: str, parallel: int = 4) -> None:
        self.url, self.parallel = url, parallel
        self.done: list[tuple[float, str]] = []  # (finish time, "ok" or what went wrong)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _one(self, c: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": f"outage test {i} " + "word " * 40, "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            async with asyncio.timeout(30):
                async with c.stream("POST", self.url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        return f"http {r.status_code}: {(await r.aread())[:200]!r}"
                    usage = None
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                return f"stream error: {chunk['error']}"
                            usage = chunk.get("usage") or usage
                    return "ok" if usage and usage["completion_tokens"] == 12 else f"incomplete: {usage}"
        except TimeoutError:
            return "hung"
        except httpx.HTTPError as exc:
            return f"transport: {exc!r}"

    async def _loop(self, k: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as c:
            i = 0
            while not self._stop.is_set():
                self.done.append((time.time(), await self._one(c, k * 100_000 + i)))
                i += 1

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(k)) for k in range(self.parallel)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def failures(self) -> list[str]:
        return [o for _, o in self.done if o != "ok"]


@pytest.fixture
async def rig(tmp_path):
    redis = RedisServer(log_dir=tmp_path)
    redis.start()
    cluster = KvyardCluster(redis.url, tmp_path, model=MODEL, prefix=f"kvyard-outage-{uuid.uuid4().hex[:6]}", lease_ttl_s=1.5)
    try:
        cluster.add_worker("w1", speedup=20)
        cluster.add_worker("w2", speedup=20)
        cluster.add_frontend("fe", policy="least-loaded")
        await cluster.wait_ready("fe", 2)
        yield redis, cluster
    finally:
        cluster.stop()
        redis.stop()


async def _watch_fleet(cluster: KvyardCluster, seen: list[tuple[int, bool]], stop: asyncio.Event) -> None:
    """Sample the frontend's view every 100 ms: (ready workers, discovery reachable)."""
    async with httpx.AsyncClient() as c:
        while not stop.is_set():
            view = await cluster.cluster_view("fe", c)
            if view is not None:
                seen.append((sum(w["state"] == "ready" for w in view["workers"]), view["discovery_ok"]))
            await asyncio.sleep(0.1)


@asynccontextmanager
async def traffic_watched(cluster: KvyardCluster) -> AsyncIterator[tuple[Traffic, list[tuple[int, bool]]]]:
    """Traffic through the frontend and its fleet view sampled (`seen`) until the block ends."""
    traffic = Traffic(cluster.url("fe"))
    seen: list[tuple[int, bool]] = []
    stop_watch = asyncio.Event()
    watcher = asyncio.create_task(_watch_fleet(cluster, seen, stop_watch))
    traffic.start()
    try:
        yield traffic, seen
    finally:
        await traffic.stop()
        stop_watch.set()
        await watcher


async def _registered(redis_url: str, prefix: str) -> int:
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url)
    try:
        return len([k async for k in r.scan_iter(match=f"{prefix}:worker:*")])
    finally:
        await r.aclose()


async def test_serving_and_telemetry_survive_a_redis_outage(rig):
    redis, cluster = rig
    async with traffic_watched(cluster) as (traffic, seen):
        await asyncio.sleep(2.0)

        redis.kill()
        t_down = time.time()
        await asyncio.sleep(5.0)  # > 3 lease ttls: every lease would have lapsed
        during = [s for s in seen if not s[1]]
        assert during, "the frontend never noticed Redis was down"
        assert all(n == 2 for n, _ in during), f"the frontend dropped workers while Redis was down: {during}"
        assert all(w.alive() for w in cluster.workers.values()), "a worker died when Redis went away"
        served_down = sum(1 for t, o in traffic.done if t > t_down + 1.0 and o == "ok")
        assert served_down > 0, "nothing was served while Redis was down"

        redis.start()  # back, empty
        t_up = time.time()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if seen and seen[-1] == (2, True) and await _registered(redis.url, cluster.prefix) == 2:
                break
            await asyncio.sleep(0.2)
        else:
            pytest.fail(f"no recovery after Redis came back: view {seen[-5:]}, "
                        f"registered {await _registered(redis.url, cluster.prefix)}")
        await asyncio.sleep(3.0)  # a few more telemetry flushes

    assert traffic.failures() == [], traffic.failures()[:5]
    assert min(n for n, _ in seen) == 2
    # telemetry kept in memory through the outage reached the restarted (empty) Redis
    store = RedisTelemetryStore(redis.url, TelemetrySchema(prefix=cluster.prefix))
    try:
        buckets = await store.read_pool_buckets(t_down - 60, time.time() + 60)
    finally:
        await store.close()
    recorded = sum(b.requests for bs in buckets.values() for b in bs)
    finished_after_kill = sum(1 for t, _ in traffic.done if t > t_down + 1.5)  # the last pre-kill flush went to the old data
    finished_in_outage = sum(1 for t, _ in traffic.done if t_down + 1.5 < t < t_up)
    assert finished_in_outage > 0
    assert recorded >= finished_after_kill, (recorded, finished_after_kill, finished_in_outage)


async def test_quick_redis_restart_keeps_the_fleet(rig):
    redis, cluster = rig
    async with traffic_watched(cluster) as (traffic, seen):
        await asyncio.sleep(1.5)
        for _ in range(3):  # three restarts, each comes back empty
            redis.restart()
            await asyncio.sleep(3.0)
            assert await _registered(redis.url, cluster.prefix) == 2, "workers did not re-register after the restart"
    assert traffic.failures() == [], traffic.failures()[:5]
    assert len(seen) > 20 and min(n for n, _ in seen) == 2, f"the frontend lost workers: {sorted(set(seen))}"
    assert all(w.alive() for w in cluster.workers.values())
