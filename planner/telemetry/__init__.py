"""Telemetry: per-pool time buckets written by frontends, read by the planner; planner targets.

    schema.py       records, the Redis key schema, parsing (malformed entries logged and skipped)
    histogram.py    fixed log-spaced latency histograms (mergeable; p50/p90/p99)
    aggregator.py   in-process aggregator the frontend records into (pure, sync)
    flusher.py      async edge: aggregator -> store about once a second
    store.py        TelemetryStore Protocol + InMemoryTelemetryStore
    redis_store.py  RedisTelemetryStore (pipelined)
    targets.py      Targets (pydantic, versioned) + TargetsStore Protocol, in-memory and Redis
"""

from planner.telemetry.aggregator import TelemetryAggregator
from planner.telemetry.flusher import TelemetryFlusher
from planner.telemetry.histogram import ITL_EDGES_MS, TTFT_EDGES_MS, Histogram
from planner.telemetry.redis_store import RedisTelemetryStore
from planner.telemetry.schema import (
    PoolBucket,
    PoolKey,
    PoolStats,
    TelemetryBatch,
    TelemetryParseError,
    TelemetrySchema,
    WorkerSample,
    merge_buckets,
    parse_bucket,
)
from planner.telemetry.store import InMemoryTelemetryStore, TelemetryStore, TelemetryUnavailableError
from planner.telemetry.targets import (
    InMemoryTargetsStore,
    PoolTarget,
    RedisTargetsStore,
    Targets,
    TargetsConflictError,
    TargetsError,
    TargetsStore,
    TargetsUnavailableError,
    TargetsValidationError,
    VersionedTargets,
    parse_targets,
)

__all__ = [
    "Histogram", "ITL_EDGES_MS", "TTFT_EDGES_MS",
    "PoolBucket", "PoolKey", "PoolStats", "TelemetryBatch", "TelemetryParseError", "TelemetrySchema", "WorkerSample",
    "merge_buckets", "parse_bucket",
    "TelemetryAggregator", "TelemetryFlusher",
    "TelemetryStore", "TelemetryUnavailableError", "InMemoryTelemetryStore", "RedisTelemetryStore",
    "PoolTarget", "Targets", "VersionedTargets", "TargetsStore", "InMemoryTargetsStore", "RedisTargetsStore",
    "TargetsError", "TargetsValidationError", "TargetsConflictError", "TargetsUnavailableError", "parse_targets",
]
