"""The same contract for the in-memory and the Redis discovery."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from workers.discovery import DiscoveryError, InMemoryDiscovery, RedisDiscovery
from workers.types import WorkerInfo, WorkerState


@pytest.fixture(params=["memory", "redis"])
async def discovery(request):
    if request.param == "memory":
        d = InMemoryDiscovery()
    else:
        d = RedisDiscovery(request.getfixturevalue("redis_url"), prefix=f"kvyard-test-{uuid.uuid4().hex[:8]}")
    yield d
    await d.close()


def info(wid: str = "w1") -> WorkerInfo:
    return WorkerInfo(worker_id=wid, model="m", backend="sim", url="http://127.0.0.1:9", block_size=32)


async def test_register_list_deregister(discovery):
    await discovery.register(info("a"), ttl_s=5)
    await discovery.register(info("b"), ttl_s=5)
    assert sorted(w.worker_id for w in await discovery.list_workers()) == ["a", "b"]
    await discovery.deregister("a")
    assert [w.worker_id for w in await discovery.list_workers()] == ["b"]


async def test_fields_round_trip(discovery):
    await discovery.register(info("a"), ttl_s=5)
    (got,) = await discovery.list_workers()
    assert got == info("a").model_copy(update={"started_at": got.started_at})


async def test_lease_lapses_without_renewal(discovery):
    await discovery.register(info("a"), ttl_s=0.3)
    await asyncio.sleep(0.5)
    assert await discovery.list_workers() == []
    assert await discovery.renew("a", 5) is False


async def test_renewal_keeps_lease(discovery):
    await discovery.register(info("a"), ttl_s=0.4)
    for _ in range(4):
        await asyncio.sleep(0.2)
        assert await discovery.renew("a", 0.4) is True
    assert [w.worker_id for w in await discovery.list_workers()] == ["a"]


async def test_state_change_keeps_lease(discovery):
    await discovery.register(info("a"), ttl_s=5)
    await discovery.set_state("a", WorkerState.DRAINING)
    (got,) = await discovery.list_workers()
    assert got.state == WorkerState.DRAINING
    await discovery.set_state("missing", WorkerState.DRAINING)  # no error for an unknown worker


async def test_redis_unreachable_raises_discovery_error():
    d = RedisDiscovery("redis://127.0.0.1:1/0")
    with pytest.raises(DiscoveryError):
        await d.list_workers()
    await d.close()


async def test_tokenizer_files_round_trip(discovery):
    assert await discovery.fetch_files("m") == {}
    files = {"tokenizer.json": b'{"x": 1}' * 1000, "tokenizer_config.json": b"{}"}
    await discovery.publish_files("m", files)
    await discovery.publish_files("m", files)  # unchanged: a no-op
    assert await discovery.fetch_files("m") == files
    await discovery.publish_files("m", {"tokenizer.json": b"new"})
    assert await discovery.fetch_files("m") == {"tokenizer.json": b"new"}


async def _wipe(d: RedisDiscovery) -> None:
    """What a Redis restarted without persistence (or flushed) looks like to this prefix."""
    keys = [k async for k in d._redis.scan_iter(match=f"{d._prefix}:*")]
    if keys:
        await d._redis.delete(*keys)


async def test_registry_reset_keeps_last_view_for_the_grace(redis_url):
    d = RedisDiscovery(redis_url, prefix=f"kvyard-test-{uuid.uuid4().hex[:8]}", reset_grace_s=0.5)
    try:
        await d.register(info("a"), ttl_s=30)
        await d.register(info("b"), ttl_s=30)
        assert [w.worker_id for w in await d.list_workers()] == ["a", "b"]
        await _wipe(d)
        # nothing re-registered yet: the last view is served, not an empty fleet
        assert [w.worker_id for w in await d.list_workers()] == ["a", "b"] and d.resets == 1
        assert await d.renew("a", 30) is False  # the worker notices its lease is gone...
        await d.register(info("a").model_copy(update={"url": "http://127.0.0.1:10"}), ttl_s=30)  # ...and re-registers
        got = {w.worker_id: w for w in await d.list_workers()}
        assert sorted(got) == ["a", "b"] and got["a"].url == "http://127.0.0.1:10"  # the fresh entry wins
        await asyncio.sleep(0.6)
        assert [w.worker_id for w in await d.list_workers()] == ["a"]  # b never came back: gone after the grace
        assert d.resets == 1
    finally:
        await d.close()


async def test_first_listing_on_an_empty_registry_is_not_a_reset(redis_url):
    d = RedisDiscovery(redis_url, prefix=f"kvyard-test-{uuid.uuid4().hex[:8]}")
    try:
        assert await d.list_workers() == []
        await d.register(info("a"), ttl_s=30)
        assert [w.worker_id for w in await d.list_workers()] == ["a"] and d.resets == 0
    finally:
        await d.close()
