"""In-process telemetry aggregator: what the frontend records into, off the token path. Pure, sync.

Per admitted request (`record_arrival`): one arrival. Per finished request (`record_request`): one count, the TTFT, the request's mean ITL weighted by
its token gaps (osl − 1 observations of (duration − ttft)/(osl − 1)), ISL and OSL. Per flush
(`record_workers`): the pool's summed waiting/running requests, mean KV usage and worker count as
one gauge sample, and each worker's prefix-cache counter deltas (hit/queried tokens) since its
previous sample (a counter that went down — engine restart — counts from zero). The first sample
of a worker is diffed against its `baseline` (scraped when it joined, before it was routable); with
none, a worker that started after the aggregator counts from zero and an older one from that sample.
`drain()` hands back everything since the last drain as a `TelemetryBatch` and starts afresh;
`restore(batch)` puts an unsent batch back (bounded by `max_pending_buckets`, oldest dropped and
counted in `dropped_buckets`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from planner.telemetry.schema import PoolBucket, PoolKey, TelemetryBatch, TelemetrySchema, WorkerSample
from workers.types import EngineMetrics, WorkerInfo

__all__ = ["TelemetryAggregator"]


class TelemetryAggregator:
    def __init__(self, schema: TelemetrySchema | None = None, clock: Callable[[], float] = time.time,
                 max_pending_buckets: int = 10_000) -> None:
        self.schema = schema or TelemetrySchema()
        self.clock = clock
        self.max_pending_buckets = max_pending_buckets
        self.dropped_buckets = 0  # buckets thrown away over the bound while the store was unreachable
        self._buckets: dict[tuple[PoolKey, float], PoolBucket] = {}
        self._workers: dict[str, WorkerSample] = {}
        self._last_counters: dict[str, tuple[float, float]] = {}
        self._since = self.clock()  # workers that started after this had zero counters when we began watching

    def _bucket(self, pool: PoolKey, now: float | None) -> PoolBucket:
        start = self.schema.bucket_start(self.clock() if now is None else now)
        b = self._buckets.get((pool, start))
        if b is None:
            b = self._buckets[(pool, start)] = PoolBucket(start=start)
        return b

    def record_arrival(self, model: str, role: str = "both", now: float | None = None) -> None:
        """Called once when a request is admitted (demand, even when the pool is saturated)."""
        self._bucket(PoolKey(model, role), now).arrivals += 1

    def record_request(self, model: str, role: str = "both", *, ttft_s: float | None, duration_s: float,
                       isl: int, osl: int, ok: bool = True, now: float | None = None) -> None:
        """Called once when a request finishes (any outcome). ttft_s None: no token was produced."""
        b = self._bucket(PoolKey(model, role), now)
        b.requests += 1
        if not ok:
            b.errors += 1
        b.isl_sum += max(isl, 0)
        b.isl_sq_sum += float(max(isl, 0)) ** 2
        b.osl_sum += max(osl, 0)
        if ttft_s is not None:
            b.ttft.observe(ttft_s * 1000.0)
            if osl > 1 and duration_s > ttft_s:
                b.itl.observe((duration_s - ttft_s) * 1000.0 / (osl - 1), weight=osl - 1)

    def baseline(self, worker_id: str, m: EngineMetrics) -> None:
        """Called when a worker joins, scraped before any request is routed to it: its prefix-cache counters
        now are where its deltas start (so traffic before the first flush counts, however soon it comes)."""
        self._last_counters.setdefault(worker_id, (m.prefix_cache_hits, m.prefix_cache_queries))

    def record_workers(self, workers: Iterable[tuple[WorkerInfo, EngineMetrics | None]], now: float | None = None) -> None:
        """Called at each flush with the frontend's live view; one gauge sample per pool."""
        now = self.clock() if now is None else now
        pools: dict[PoolKey, list[EngineMetrics]] = {}
        for info, m in workers:
            pool = PoolKey(info.model, info.role.value)
            if m is None:
                pools.setdefault(pool, [])
                continue
            pools.setdefault(pool, []).append(m)
            self._workers[info.worker_id] = WorkerSample(info.worker_id, info.model, info.role.value, m, now)
            prev = self._last_counters.get(info.worker_id)
            if prev is None and info.started_at >= self._since:
                # first sight of a worker that started while we watched: its counters are all new traffic (a first
                # scrape that lands after a burst would otherwise drop that burst's hits from the hit rate)
                prev = (0.0, 0.0)
            self._last_counters[info.worker_id] = (m.prefix_cache_hits, m.prefix_cache_queries)
            if prev is not None:
                dh, dq = m.prefix_cache_hits - prev[0], m.prefix_cache_queries - prev[1]
                if dq < 0 or dh < 0:  # engine restarted: its counters began again
                    dh, dq = m.prefix_cache_hits, m.prefix_cache_queries
                b = self._bucket(pool, now)
                b.kv_hit_tokens += max(dh, 0.0)
                b.kv_query_tokens += max(dq, 0.0)
        for pool, ms in pools.items():
            b = self._bucket(pool, now)
            b.gauge_samples += 1
            b.queue_sum += sum(m.num_requests_waiting for m in ms)
            b.running_sum += sum(m.num_requests_running for m in ms)
            b.kv_usage_sum += sum(m.kv_cache_usage for m in ms) / len(ms) if ms else 0.0
            b.workers_sum += len(ms)

    def drain(self) -> TelemetryBatch:
        batch = TelemetryBatch(buckets=self._buckets, workers=list(self._workers.values()))
        self._buckets, self._workers = {}, {}
        return batch

    def restore(self, batch: TelemetryBatch) -> None:
        """Merge an unsent batch back (newer records already taken win for worker samples)."""
        for key, b in batch.buckets.items():
            mine = self._buckets.get(key)
            if mine is None:
                self._buckets[key] = b
            else:
                mine.merge(b)
        for w in batch.workers:
            self._workers.setdefault(w.worker_id, w)
        if len(self._buckets) > self.max_pending_buckets:
            excess = len(self._buckets) - self.max_pending_buckets
            for key in sorted(self._buckets, key=lambda k: k[1])[:excess]:
                del self._buckets[key]
            self.dropped_buckets += excess

    @property
    def pending(self) -> int:
        return len(self._buckets)
