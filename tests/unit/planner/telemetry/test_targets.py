"""Targets: validation with clear errors, versioning and history, the same contract in memory and Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from planner.telemetry import (
    InMemoryTargetsStore,
    RedisTargetsStore,
    TargetsConflictError,
    TargetsValidationError,
    parse_targets,
)

GOOD = {"pools": [{"model": "m", "role": "decode", "ttft_p90_ms": 500, "itl_p90_ms": 25, "min_replicas": 1, "max_replicas": 4}],
        "gpu_budget": 8}


@pytest.mark.parametrize("patch,field,words", [
    ({"ttft_p90_ms": -1}, "pools.0.ttft_p90_ms", "greater than 0"),
    ({"itl_p90_ms": "fast"}, "pools.0.itl_p90_ms", "valid number"),
    ({"min_replicas": 5, "max_replicas": 2}, "pools.0", "below min_replicas"),
    ({"role": "chef"}, "pools.0.role", "'both', 'prefill' or 'decode'"),
    ({"colour": "red"}, "pools.0.colour", "Extra inputs"),
    ({"model": ""}, "pools.0.model", "at least 1"),
])
def test_bad_pool_targets_are_refused_with_the_field(patch, field, words):
    data = {"pools": [{**GOOD["pools"][0], **patch}]}
    with pytest.raises(TargetsValidationError) as ei:
        parse_targets(data)
    assert ei.value.field == field
    assert words in str(ei.value)


@pytest.mark.parametrize("data,words", [
    ({"pools": [GOOD["pools"][0], GOOD["pools"][0]]}, "listed twice"),
    ({"pools": [{**GOOD["pools"][0], "min_replicas": 3, "gpus_per_replica": 4}], "gpu_budget": 8}, "below the GPUs"),
    ({"gpu_budget": 0}, "greater than or equal to 1"),
    ("not json", "Invalid JSON"),
])
def test_inconsistent_targets(data, words):
    with pytest.raises(TargetsValidationError, match=words):
        parse_targets(data)


def test_good_targets_parse():
    t = parse_targets(GOOD)
    assert t.pool("m", "decode").itl_p90_ms == 25 and t.pool("m", "prefill") is None


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def tstore(request):
    if request.param == "memory":
        s = InMemoryTargetsStore(history_cap=3)
    else:
        s = RedisTargetsStore(request.getfixturevalue("redis_url"), prefix=f"kvyard-test-{uuid.uuid4().hex[:8]}", history_cap=3)
    yield s
    await s.close()


async def test_versions_and_history(tstore):
    assert await tstore.get() is None
    v1 = await tstore.put(parse_targets(GOOD), actor="alice")
    assert v1.version == 1 and v1.updated_by == "alice"
    for i in range(3):
        await tstore.put(parse_targets({**GOOD, "gpu_budget": 10 + i}))
    cur = await tstore.get()
    assert cur.version == 4 and cur.targets.gpu_budget == 12
    assert cur.targets == parse_targets({**GOOD, "gpu_budget": 12})
    hist = await tstore.history(10)
    assert [h.version for h in hist] == [4, 3, 2]  # capped at 3
    assert hist[0] == cur


async def test_expected_version(tstore):
    with pytest.raises(TargetsConflictError):
        await tstore.put(parse_targets(GOOD), expected_version=3)
    v1 = await tstore.put(parse_targets(GOOD), expected_version=0)
    await tstore.put(parse_targets(GOOD), expected_version=v1.version)
    with pytest.raises(TargetsConflictError, match="version 2"):
        await tstore.put(parse_targets(GOOD), expected_version=1)


async def test_concurrent_writers_never_lose_a_version(tstore):
    results = await asyncio.gather(*(tstore.put(parse_targets({**GOOD, "gpu_budget": 8 + i})) for i in range(8)))
    assert sorted(r.version for r in results) == list(range(1, 9))
    assert (await tstore.get()).version == 8
