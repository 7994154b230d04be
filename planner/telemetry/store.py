"""TelemetryStore: where frontends write per-pool telemetry and the planner reads it back.

Two implementations pass the same contract tests: `InMemoryTelemetryStore` (the embedded default of
`kvyard up`, and unit tests) and `RedisTelemetryStore` (redis_store.py; key schema in schema.py).
Retention: buckets older than `retention_s`, worker samples older than `worker_ttl_s`, and decisions
beyond `decisions_cap` are dropped.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from planner.telemetry.schema import PoolBucket, PoolKey, TelemetryBatch, TelemetrySchema, WorkerSample

__all__ = ["TelemetryStore", "TelemetryUnavailableError", "InMemoryTelemetryStore"]


class TelemetryUnavailableError(RuntimeError):
    """The store could not be reached; writers keep their batch, the planner holds still."""


@runtime_checkable
class TelemetryStore(Protocol):
    schema: TelemetrySchema

    async def write(self, batch: TelemetryBatch) -> None:
        """Called by a flusher about once a second: merges bucket deltas, replaces worker samples.
        Raises TelemetryUnavailableError (the caller keeps the batch and retries)."""
        ...

    async def read_pool_buckets(self, since: float, until: float) -> dict[PoolKey, list[PoolBucket]]:
        """Called by the planner each tick: buckets whose start lies in [since, until), per pool,
        oldest first. Malformed entries are logged and skipped."""
        ...

    async def read_workers(self, now: float | None = None) -> list[WorkerSample]:
        """The newest sample of every worker seen within worker_ttl_s."""
        ...

    async def append_decision(self, record: dict) -> None:
        """Called by the planner loop after each tick (JSON-able dict); capped at decisions_cap."""
        ...

    async def recent_decisions(self, limit: int = 100) -> list[dict]:
        """Newest first."""
        ...

    async def close(self) -> None: ...


class InMemoryTelemetryStore:
    def __init__(self, schema: TelemetrySchema | None = None, clock: Callable[[], float] = time.time) -> None:
        self.schema = schema or TelemetrySchema()
        self.clock = clock
        self._buckets: dict[tuple[PoolKey, float], PoolBucket] = {}
        self._workers: dict[str, WorkerSample] = {}
        self._decisions: list[str] = []

    def _prune(self, now: float) -> None:
        horizon = now - self.schema.retention_s
        for key in [k for k in self._buckets if k[1] < horizon]:
            del self._buckets[key]
        stale = now - self.schema.worker_ttl_s
        for wid in [w for w, s in self._workers.items() if s.at < stale]:
            del self._workers[wid]

    async def write(self, batch: TelemetryBatch) -> None:
        for key, b in batch.buckets.items():
            mine = self._buckets.get(key)
            if mine is None:
                self._buckets[key] = copy.deepcopy(b)
            else:
                mine.merge(b)
        for w in batch.workers:
            self._workers[w.worker_id] = copy.deepcopy(w)
        self._prune(self.clock())

    async def read_pool_buckets(self, since: float, until: float) -> dict[PoolKey, list[PoolBucket]]:
        self._prune(self.clock())
        out: dict[PoolKey, list[PoolBucket]] = {}
        for (pool, start), b in sorted(self._buckets.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if since <= start < until:
                out.setdefault(pool, []).append(copy.deepcopy(b))
        return out

    async def read_workers(self, now: float | None = None) -> list[WorkerSample]:
        now = self.clock() if now is None else now
        stale = now - self.schema.worker_ttl_s
        return [copy.deepcopy(s) for _, s in sorted(self._workers.items()) if s.at >= stale]

    async def append_decision(self, record: dict) -> None:
        self._decisions.insert(0, json.dumps(record, default=str))
        del self._decisions[self.schema.decisions_cap:]

    async def recent_decisions(self, limit: int = 100) -> list[dict]:
        return [json.loads(r) for r in self._decisions[:limit]]

    async def close(self) -> None:
        return None
