"""The telemetry parsers, fuzzed: whatever Redis hands back (another version's fields, a hand edit,
binary junk), reading raises only TelemetryParseError, and the *skipping* readers never raise.
A round trip of well-formed data is exact, and the store's readers skip junk entries in real Redis."""

from __future__ import annotations

import math
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.telemetry.redis_store import RedisTelemetryStore
from planner.telemetry.schema import (PoolBucket, PoolKey, TelemetryBatch, TelemetryParseError, TelemetrySchema, WorkerSample,
                                      bucket_from_fields, parse_bucket)
from planner.telemetry.targets import TargetsValidationError, parse_targets
from workers.types import EngineMetrics

FUZZ = settings(max_examples=300, deadline=None)

field_names = st.one_of(st.sampled_from(["a", "n", "err", "gn", "isl", "isl2", "osl", "q", "r", "kv", "w", "kvh", "kvq", "ts", "is",
                                          "t:0", "i:3", "t:-1", "t:999", "i:x", "model", "role", "at", "m:kv_cache_usage",
                                          "m:num_requests_waiting", "m:nope"]), st.text(max_size=8))
raw_values = st.one_of(st.binary(max_size=12), st.text(max_size=12),
                       st.sampled_from([b"1", b"-1", b"1e400", b"nan", b"inf", b"-inf", b"0.5", b"\xff\xfe", b"", b"9" * 400]),
                       st.integers(-(2**70), 2**70), st.floats(allow_nan=True))
raw_hashes = st.dictionaries(st.one_of(field_names, field_names.map(str.encode), st.binary(max_size=6)), raw_values, max_size=8)


@FUZZ
@given(raw_hashes, st.floats(0, 2e9))
def test_bucket_reader_raises_only_parse_error(raw, start):
    try:
        b = bucket_from_fields(start, raw)
    except TelemetryParseError:
        assert parse_bucket(start, raw) is None  # the skipping reader logs and skips
        return
    assert isinstance(b, PoolBucket) and parse_bucket(start, raw) is not None
    assert math.isfinite(b.ttft.sum) and b.ttft.total >= 0 and b.itl.total >= 0


@FUZZ
@given(raw_hashes, st.text(max_size=10))
def test_worker_sample_reader_raises_only_parse_error(raw, wid):
    try:
        s = WorkerSample.from_fields(wid, raw)
    except TelemetryParseError:
        return
    assert s.worker_id == wid and math.isfinite(s.at)


@FUZZ
@given(st.text(max_size=20))
def test_pool_id_reader_raises_only_parse_error(pool_id):
    try:
        key = PoolKey.from_id(pool_id)
    except TelemetryParseError:
        return
    assert PoolKey.from_id(key.id) == key


@FUZZ
@given(st.text(min_size=1, max_size=20), st.sampled_from(["both", "prefill", "decode"]))
def test_pool_id_round_trip(model, role):
    key = PoolKey(model, role)
    assert PoolKey.from_id(key.id) == key


json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=4), max_leaves=15)
target_keys = st.sampled_from(["pools", "model", "role", "ttft_ms", "itl_ms", "min_replicas", "max_replicas", "mode", "tps", "version"])


@FUZZ
@given(st.one_of(json_values, st.dictionaries(target_keys, json_values, max_size=4),
                 st.dictionaries(target_keys, st.lists(st.dictionaries(target_keys, json_values, max_size=6), max_size=3), max_size=2)))
def test_targets_parser_raises_only_validation_error(data):
    try:
        parse_targets(data)
    except TargetsValidationError:
        pass


@pytest.mark.redis
async def test_store_readers_skip_junk_in_redis(redis_url):
    """Junk written straight into the store's keys is skipped; the good entries are still read."""
    schema = TelemetrySchema(prefix=f"kvyard-fuzz-{uuid.uuid4().hex[:8]}", bucket_s=10)
    store = RedisTelemetryStore(redis_url, schema)
    r = store._redis
    now = time.time()
    start = schema.bucket_start(now)
    good = PoolBucket(start=start)
    good.requests, good.arrivals = 3, 4
    sample = WorkerSample("w1", "m", "both", EngineMetrics(kv_cache_usage=0.5), now)
    try:
        await store.write(TelemetryBatch(buckets={(PoolKey("m"), start): good}, workers=[sample]))
        await r.zadd(schema.pools_key, {"no-separator": now, "m2|both": now, "\udcff".encode("utf-8", "surrogatepass"): now})
        await r.hset(schema.bucket_key(PoolKey("m2"), start), mapping={"n": b"\xff\xfe", "a": "1"})
        await r.zadd(schema.workers_key, {"w2": now, "w3": now})
        await r.hset(schema.worker_key("w2"), mapping={"model": "m", "role": "nope", "at": str(now)})
        await r.hset(schema.worker_key("w3"), mapping={b"\xff": b"\xfe", "model": "m", "role": "both", "at": str(now)})
        await r.lpush(schema.decisions_key, b"\xff not json", b"[1, 2]", b'{"tick": 1}')
        buckets = await store.read_pool_buckets(now - 60, now + 60)
        assert list(buckets) == [PoolKey("m")] and buckets[PoolKey("m")][0].requests == 3
        assert [w.worker_id for w in await store.read_workers(now)] == ["w1", "w3"]  # w3's junk field is ignored
        assert await store.recent_decisions() == [{"tick": 1}]
    finally:
        keys = [k async for k in r.scan_iter(match=f"{schema.prefix}:*")]
        if keys:
            await r.delete(*keys)
        await store.close()
