"""Frontend side of telemetry: record per request into an in-process aggregator (no I/O on the
request path), flush to the TelemetryStore about once a second with the live worker view.

Hooks (see the planner report): `on_arrival(model, role)` when a request has been routed,
`on_finish(model, role, ttft_s=..., duration_s=..., isl=..., osl=..., ok=...)` when it ends (stream
closed, unary answered, or failed). `start()` in the app lifespan, `await close()` on shutdown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from workers.telemetry.aggregator import TelemetryAggregator
from workers.telemetry.flusher import TelemetryFlusher
from workers.telemetry.redis_store import RedisTelemetryStore
from workers.telemetry.schema import TelemetrySchema
from workers.telemetry.store import InMemoryTelemetryStore, TelemetryStore
from workers.types import EngineMetrics, WorkerInfo

__all__ = ["FrontendTelemetry", "make_telemetry_store"]


def make_telemetry_store(redis_url: str | None, prefix: str = "kvyard") -> TelemetryStore:
    """Redis when a URL is configured, else in memory (the embedded `kvyard up` default)."""
    schema = TelemetrySchema(prefix=prefix)
    return RedisTelemetryStore(redis_url, schema) if redis_url else InMemoryTelemetryStore(schema)


class FrontendTelemetry:
    def __init__(self, store: TelemetryStore,
                 workers: Callable[[], Iterable[tuple[WorkerInfo, EngineMetrics | None]]] | None = None,
                 interval_s: float = 1.0) -> None:
        self.store = store
        self.aggregator = TelemetryAggregator(store.schema)
        self.flusher = TelemetryFlusher(self.aggregator, store, interval_s, workers)

    @classmethod
    def for_pool(cls, store: TelemetryStore, pool, interval_s: float = 1.0) -> FrontendTelemetry:
        """`pool` is the frontend's WorkerPool: its live workers and their last scraped metrics."""
        return cls(store, lambda: [(w.info, w.metrics) for w in pool.workers.values()], interval_s)

    def on_arrival(self, model: str, role: str = "both") -> None:
        self.aggregator.record_arrival(model, role)

    def on_finish(self, model: str, role: str = "both", *, ttft_s: float | None, duration_s: float, isl: int, osl: int,
                  ok: bool = True) -> None:
        self.aggregator.record_request(model, role, ttft_s=ttft_s, duration_s=duration_s, isl=isl, osl=osl, ok=ok)

    def start(self) -> None:
        self.flusher.start()

    async def close(self) -> None:
        await self.flusher.close()
