"""Telemetry records and their Redis key schema. Pure: no I/O here.

A *pool* is (model, role). The frontend aggregates what it sees into per-pool time buckets of
`bucket_s` seconds (default 10) and flushes deltas about once a second; the store merges them.

Redis schema (prefix defaults to "kvyard"; `{pool}` = quote(model) + "|" + role):
    {prefix}:tm:pool:{pool}:{start}  HASH    one time bucket, start = epoch seconds, a multiple of
                                             bucket_s; fields below, merged with HINCRBY(FLOAT);
                                             EXPIRE retention_s (default 6 h) from the last write
    {prefix}:tm:pools                ZSET    pool id -> epoch of its last write (pruned past retention)
    {prefix}:tm:worker:{worker_id}   HASH    latest normalised EngineMetrics of one worker + model,
                                             role, at; EXPIRE worker_ttl_s (default 60 s)
    {prefix}:tm:workers              ZSET    worker id -> epoch of its last sample
    {prefix}:planner:decisions       LIST    planner decisions as JSON, newest first, capped (LTRIM)
Bucket hash fields:
    a                 requests that arrived (counted when admitted)
    n, err            requests finished, of which failed
    isl, osl          prompt / generated tokens of the finished requests (sums)
    isl2              sum of squared prompt lengths (spread of the prefill work: CV²)
    kvh, kvq          prefix-cache hit / queried prompt tokens (engine counter deltas)
    gn, gq, gr, gk, gw  gauge samples taken at flush: count, then sums of the pool's waiting
                      requests, running requests, mean KV usage (0..1) and worker count
    t:{i}, ts         TTFT histogram count in bucket i (histogram.TTFT_EDGES_MS), and sum (ms)
    i:{i}, is         ITL histogram count in bucket i (histogram.ITL_EDGES_MS), and sum (ms)
Derived per window: arrival rate = a/s, finish rate = n/s, tokens/s = osl/s, kv hit rate = kvh/kvq, p50/p90/p99 from t:*/i:*.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, fields
from urllib.parse import quote, unquote

from planner.telemetry.histogram import ITL_EDGES_MS, TTFT_EDGES_MS, Histogram
from workers.types import EngineMetrics, WorkerRole

__all__ = [
    "PoolKey", "PoolBucket", "PoolStats", "WorkerSample", "TelemetryBatch", "TelemetrySchema",
    "TelemetryParseError", "bucket_from_fields", "parse_bucket", "merge_buckets",
]

log = logging.getLogger("kvyard.telemetry")

_SCALARS = {"a": "arrivals", "n": "requests", "err": "errors", "isl": "isl_sum", "isl2": "isl_sq_sum", "osl": "osl_sum", "kvh": "kv_hit_tokens",
            "kvq": "kv_query_tokens", "gn": "gauge_samples", "gq": "queue_sum", "gr": "running_sum",
            "gk": "kv_usage_sum", "gw": "workers_sum", "ts": "ttft_sum", "is": "itl_sum"}


class TelemetryParseError(ValueError):
    """A stored telemetry entry could not be read (wrong type, unknown field value, bad number)."""


@dataclass(frozen=True, slots=True, order=True)
class PoolKey:
    model: str
    role: str = WorkerRole.BOTH.value

    @property
    def id(self) -> str:
        return f"{quote(self.model, safe='')}|{self.role}"

    @classmethod
    def from_id(cls, pool_id: str) -> PoolKey:
        model, sep, role = pool_id.rpartition("|")
        if not sep or not model or role not in {r.value for r in WorkerRole}:
            raise TelemetryParseError(f"bad pool id {pool_id!r}")
        return cls(unquote(model), role)

    def __str__(self) -> str:
        return f"{self.model}/{self.role}"


@dataclass(slots=True)
class PoolBucket:
    """Counts for one pool over one time bucket (or a delta of it, or a merge of several)."""

    start: float
    arrivals: int = 0
    requests: int = 0
    errors: int = 0
    isl_sum: float = 0.0
    isl_sq_sum: float = 0.0
    osl_sum: float = 0.0
    kv_hit_tokens: float = 0.0
    kv_query_tokens: float = 0.0
    gauge_samples: int = 0
    queue_sum: float = 0.0
    running_sum: float = 0.0
    kv_usage_sum: float = 0.0
    workers_sum: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_EDGES_MS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_EDGES_MS))

    def merge(self, other: PoolBucket) -> None:
        for name in _SCALARS.values():
            if name in ("ttft_sum", "itl_sum"):
                continue
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ttft.merge(other.ttft)
        self.itl.merge(other.itl)

    def is_empty(self) -> bool:
        return self.arrivals == 0 and self.requests == 0 and self.gauge_samples == 0 and self.kv_query_tokens == 0 and self.errors == 0

    def to_fields(self) -> dict[str, float]:
        """Non-zero fields for HINCRBY / HINCRBYFLOAT (ints stay ints)."""
        out: dict[str, float] = {}
        for short, name in _SCALARS.items():
            if name == "ttft_sum":
                value = self.ttft.sum
            elif name == "itl_sum":
                value = self.itl.sum
            else:
                value = getattr(self, name)
            if value:
                out[short] = value
        for prefix, hist in (("t", self.ttft), ("i", self.itl)):
            for i, c in hist.counts.items():
                if c:
                    out[f"{prefix}:{i}"] = c
        return out


def _num(raw: object) -> float:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite {text!r}")
    return value


def bucket_from_fields(start: float, raw: dict) -> PoolBucket:
    """Rebuild a bucket from a Redis hash; raises TelemetryParseError on any malformed field."""
    b = PoolBucket(start=start)
    for key, value in raw.items():
        k = key.decode(errors="replace") if isinstance(key, bytes) else str(key)  # junk bytes: an unknown field
        try:
            v = _num(value)
            if k in _SCALARS:
                name = _SCALARS[k]
                if name == "ttft_sum":
                    b.ttft.sum = v
                elif name == "itl_sum":
                    b.itl.sum = v
                else:
                    setattr(b, name, int(v) if name in ("arrivals", "requests", "errors", "gauge_samples") else v)
            elif k[:2] in ("t:", "i:"):
                hist = b.ttft if k[0] == "t" else b.itl
                idx, count = int(k[2:]), int(v)
                if not 0 <= idx <= len(hist.edges) or count < 0:
                    raise ValueError(f"histogram index {idx} or count {count} out of range")
                hist.counts[idx] = hist.counts.get(idx, 0) + count
                hist.total += count
            else:
                raise ValueError("unknown field")
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise TelemetryParseError(f"bucket {start:.0f}: field {k!r}={value!r}: {exc}") from exc
    return b


def parse_bucket(start: float, raw: dict, where: str = "") -> PoolBucket | None:
    """Like bucket_from_fields, but logs and skips (returns None) a malformed entry."""
    try:
        return bucket_from_fields(start, raw)
    except TelemetryParseError as exc:
        log.warning("skipping malformed telemetry %s: %s", where, exc)
        return None


@dataclass(slots=True)
class PoolStats:
    """What a window of buckets says about a pool (None where nothing was measured)."""

    pool: PoolKey
    window_s: float
    requests: int
    request_rate: float  # finished requests per second
    arrival_rate: float  # admitted requests per second (0 if the frontend does not record arrivals)
    avg_isl: float | None
    isl_cv2: float | None  # squared coefficient of variation of the prompt lengths
    avg_osl: float | None
    tokens_per_s: float  # generated tokens per second
    kv_hit_rate: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    queue_depth: float | None  # mean waiting requests over the pool
    running: float | None
    kv_usage: float | None  # mean over workers and samples
    workers: float | None  # mean worker count seen
    errors: int = 0
    last_bucket_start: float | None = None


def _cv2(m: PoolBucket) -> float | None:
    if m.requests < 2 or m.isl_sum <= 0:
        return None
    mean = m.isl_sum / m.requests
    return max(m.isl_sq_sum / m.requests - mean * mean, 0.0) / (mean * mean)


def merge_buckets(pool: PoolKey, buckets: list[PoolBucket], window_s: float) -> PoolStats:
    m = PoolBucket(start=min((b.start for b in buckets), default=0.0))
    for b in buckets:
        m.merge(b)
    g = m.gauge_samples
    w = max(window_s, 1e-9)
    return PoolStats(
        pool=pool, window_s=window_s, requests=m.requests, request_rate=m.requests / w, arrival_rate=m.arrivals / w,
        avg_isl=m.isl_sum / m.requests if m.requests else None, isl_cv2=_cv2(m), avg_osl=m.osl_sum / m.requests if m.requests else None,
        tokens_per_s=m.osl_sum / w, kv_hit_rate=m.kv_hit_tokens / m.kv_query_tokens if m.kv_query_tokens else None,
        ttft_p50_ms=m.ttft.quantile(0.5), ttft_p90_ms=m.ttft.quantile(0.9), ttft_p99_ms=m.ttft.quantile(0.99),
        itl_p50_ms=m.itl.quantile(0.5), itl_p90_ms=m.itl.quantile(0.9), itl_p99_ms=m.itl.quantile(0.99),
        queue_depth=m.queue_sum / g if g else None, running=m.running_sum / g if g else None,
        kv_usage=m.kv_usage_sum / g if g else None, workers=m.workers_sum / g if g else None,
        errors=m.errors, last_bucket_start=max((b.start for b in buckets), default=None),
    )


@dataclass(slots=True)
class WorkerSample:
    """The latest engine metrics of one worker, as the frontend scraped them."""

    worker_id: str
    model: str
    role: str
    metrics: EngineMetrics
    at: float

    def to_fields(self) -> dict[str, str]:
        out = {"model": self.model, "role": self.role, "at": repr(self.at)}
        out.update({f"m:{k}": repr(float(v)) for k, v in asdict(self.metrics).items()})
        return out

    @classmethod
    def from_fields(cls, worker_id: str, raw: dict) -> WorkerSample:
        d = {(k.decode(errors="replace") if isinstance(k, bytes) else k): (v.decode(errors="replace") if isinstance(v, bytes) else v)
             for k, v in raw.items()}  # junk bytes become U+FFFD: an ignored field or a bad number, never UnicodeDecodeError
        try:
            names = {f.name for f in fields(EngineMetrics)}
            metrics = EngineMetrics(**{k[2:]: _num(v) for k, v in d.items() if k.startswith("m:") and k[2:] in names})
            role = d["role"]
            if role not in {r.value for r in WorkerRole}:
                raise ValueError(f"unknown role {role!r}")
            return cls(worker_id=worker_id, model=d["model"], role=role, metrics=metrics, at=_num(d["at"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise TelemetryParseError(f"worker {worker_id}: {exc!r}") from exc


@dataclass(slots=True)
class TelemetryBatch:
    """One flush: bucket deltas per pool and the newest sample of each worker."""

    buckets: dict[tuple[PoolKey, float], PoolBucket] = field(default_factory=dict)
    workers: list[WorkerSample] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.buckets and not self.workers


@dataclass(frozen=True, slots=True)
class TelemetrySchema:
    prefix: str = "kvyard"
    bucket_s: int = 10
    retention_s: int = 6 * 3600
    worker_ttl_s: int = 60
    decisions_cap: int = 1000

    def bucket_start(self, t: float) -> float:
        return float(math.floor(t / self.bucket_s) * self.bucket_s)

    def bucket_key(self, pool: PoolKey, start: float) -> str:
        return f"{self.prefix}:tm:pool:{pool.id}:{int(start)}"

    @property
    def pools_key(self) -> str:
        return f"{self.prefix}:tm:pools"

    def worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}:tm:worker:{worker_id}"

    @property
    def workers_key(self) -> str:
        return f"{self.prefix}:tm:workers"

    @property
    def decisions_key(self) -> str:
        return f"{self.prefix}:planner:decisions"
