"""Per-key rate limits kept in real Redis: shared by every frontend of a cluster, and falling back to
per-frontend buckets while Redis is unreachable (serving never stops)."""

from __future__ import annotations

import logging
import os
import uuid

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.errors import RateLimitError
from orchestrator.security import KeyFile, Principal, RedisRateLimiter, generate_key, save_key_file
from orchestrator.testing import FakeEngine, free_port, winfo
from workers.discovery import InMemoryDiscovery

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("KVYARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
async def prefix():
    p = f"kvyard-rl-{uuid.uuid4().hex[:8]}"
    yield p
    import redis.asyncio as aioredis

    r = aioredis.from_url(REDIS_URL)
    keys = [k async for k in r.scan_iter(match=f"{p}:*", count=500)]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def test_two_frontends_share_one_bucket(prefix):
    a, b = RedisRateLimiter(REDIS_URL, prefix), RedisRateLimiter(REDIS_URL, prefix)
    p = Principal("0123456789ab", "t", rpm=4, tpm=1000)
    try:
        grants = [await lim.admit(p, 100) for lim in (a, b, a, b)]
        assert [g.remaining_requests for g in grants] == [3, 2, 1, 0]
        assert [g.remaining_tokens for g in grants] == [900, 800, 700, 600]  # refill between calls is a fraction of a token
        with pytest.raises(RateLimitError) as info:
            await b.admit(p)
        assert "requests per minute" in info.value.message and info.value.retry_after >= 1
        assert info.value.headers["x-ratelimit-remaining-requests"] == "0"
        other = Principal("ba9876543210", "u", tpm=100)  # keys do not share buckets; tokens may go into debt once
        assert (await a.admit(other, 250)).remaining_tokens == 0
        with pytest.raises(RateLimitError) as info:
            await b.admit(other, 1)
        assert "tokens per minute" in info.value.message and 85 <= info.value.retry_after <= 92  # (150 + 1) / (100/60)
    finally:
        await a.close()
        await b.close()


async def test_redis_outage_falls_back_to_local_buckets(caplog):
    lim = RedisRateLimiter(f"redis://127.0.0.1:{free_port()}/0", "x", timeout_s=0.2)  # nothing listens there
    p = Principal("0123456789ab", "t", rpm=2)
    try:
        assert (await lim.admit(p)).remaining_requests == 1
        assert (await lim.admit(p)).remaining_requests == 0
        with pytest.raises(RateLimitError):
            await lim.admit(p)  # still limited, per frontend
        assert caplog.text.count("Redis unreachable") == 1  # warned once, not per request
    finally:
        await lim.close()


async def test_limits_hold_across_two_apps(tmp_path, prefix):
    key, rec = generate_key("shared", rpm=3)
    save_key_file(tmp_path / "keys.yaml", KeyFile(keys=[rec]))
    cfg = FrontendConfig(redis_url=REDIS_URL, discovery_prefix=prefix, refresh_interval_s=60, grpc_port=0, security={"api_keys_file": tmp_path / "keys.yaml"}, telemetry={"enabled": False})
    with FakeEngine() as eng:
        apps, clients = [], []
        for _ in range(2):
            disc = InMemoryDiscovery()
            await disc.register(winfo("a", eng.url), ttl_s=60)
            app = create_app(cfg, disc)
            apps.append(app)
        async with apps[0].router.lifespan_context(apps[0]), apps[1].router.lifespan_context(apps[1]):
            for app in apps:
                await app.state.pool.refresh()
                clients.append(httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvyard"))
            h = {"authorization": f"Bearer {key}"}
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            codes = [(await c.post("/v1/completions", json=body, headers=h)).status_code for c in (clients[0], clients[1], clients[0], clients[1])]
            assert codes == [200, 200, 200, 429]
            for c in clients:
                await c.aclose()
