"""Parsing stored telemetry: round trip, and malformed entries are refused (or logged and skipped)."""

from __future__ import annotations

import logging

import pytest

from planner.telemetry import PoolKey, TelemetryAggregator, TelemetryParseError, WorkerSample, parse_bucket
from planner.telemetry.schema import bucket_from_fields
from workers.types import EngineMetrics


def test_pool_id_round_trip_with_odd_model_names():
    for model in ("m", "org/Model-8B:fp8", "a|b", "x y%z"):
        key = PoolKey(model, "prefill")
        assert PoolKey.from_id(key.id) == key
        assert ":" not in key.id.replace("%3A", "")


@pytest.mark.parametrize("bad", ["nope", "m|nope", "|decode"])
def test_bad_pool_ids(bad):
    with pytest.raises(TelemetryParseError):
        PoolKey.from_id(bad)


def test_bucket_fields_round_trip():
    agg = TelemetryAggregator()
    agg.record_request("m", ttft_s=0.25, duration_s=2.0, isl=300, osl=8, now=0.0)
    (b,) = agg.drain().buckets.values()
    raw = {k.encode(): str(v).encode() for k, v in b.to_fields().items()}
    back = bucket_from_fields(0.0, raw)
    assert (back.requests, back.isl_sum, back.osl_sum) == (1, 300, 8)
    assert back.ttft.counts == b.ttft.counts and back.itl.counts == b.itl.counts
    assert back.itl.sum == pytest.approx(b.itl.sum)


@pytest.mark.parametrize("raw", [
    {b"n": b"x"},            # not a number
    {b"n": b"inf"},          # not finite
    {b"t:9999": b"1"},       # histogram index out of range
    {b"t:3": b"-2"},         # negative count
    {b"zz": b"1"},           # unknown field
    {b"i:abc": b"1"},        # bad index
])
def test_malformed_bucket_fields(raw, caplog):
    with pytest.raises(TelemetryParseError):
        bucket_from_fields(0.0, raw)
    with caplog.at_level(logging.WARNING, logger="kvyard.telemetry"):
        assert parse_bucket(0.0, raw, where="k") is None
    assert "skipping malformed telemetry" in caplog.text


def test_worker_sample_round_trip_and_malformed():
    s = WorkerSample("w", "m", "decode", EngineMetrics(num_requests_running=3, kv_cache_usage=0.5, scraped_at=1.0), at=5.0)
    back = WorkerSample.from_fields("w", {k.encode(): v.encode() for k, v in s.to_fields().items()})
    assert back == s
    for raw in ({"model": "m"}, {"model": "m", "role": "chef", "at": "1"}, {"model": "m", "role": "both", "at": "x"}):
        with pytest.raises(TelemetryParseError):
            WorkerSample.from_fields("w", raw)
