"""Frontend side of telemetry: record per request into an in-process aggregator (no I/O on the
request path), flush to the TelemetryStore about once a second with the live worker view.

Hooks: `on_arrival(model)` when a request has been routed, `on_finish(model, ttft_s=..., duration_s=...,
isl=..., osl=..., ok=...)` when it ends (stream closed, unary answered, or failed). `start()` in the app
lifespan, `await close()` on shutdown.

Pools by role (the planner sizes each on its own target, as Dynamo's does: TTFT -> prefill, ITL ->
decode). With no `role` given, the request is attributed from the roles (WorkerInfo.role) of the
model's live workers, the same rule the disaggregation coordinator serves by:
    prefill and decode/both workers  (disaggregated)
        (model, "prefill")  arrival; on finish: the prompt's part — TTFT, ISL, OSL; duration = TTFT,
                            so no ITL is recorded there
        (model, "decode")   arrival; on finish: the whole request — ITL (and the end-to-end TTFT,
                            which load mode ignores for decode pools); "both" when there is no
                            decode worker
    otherwise (aggregated)
        (model, "both")     or (model, "decode") when the model only has decode workers (and no
                            live worker at all: "both")
A request the coordinator served locally on its decode worker still counts as prefill demand (it
cannot tell from here); Dynamo's planner sizes prefill on the whole request rate the same way.
A `role` passed explicitly records there only. Worker gauges (queue, KV usage, prefix hits) are
always recorded under each worker's own role.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from planner.telemetry.aggregator import TelemetryAggregator
from planner.telemetry.flusher import TelemetryFlusher
from planner.telemetry.redis_store import RedisTelemetryStore
from planner.telemetry.schema import TelemetrySchema
from planner.telemetry.store import InMemoryTelemetryStore, TelemetryStore
from workers.types import EngineMetrics, WorkerInfo

__all__ = ["FrontendTelemetry", "make_telemetry_store"]

log = logging.getLogger("kvyard.telemetry")


def make_telemetry_store(redis_url: str | None, prefix: str = "kvyard") -> TelemetryStore:
    """Redis when a URL is configured, else in memory (the embedded `kvyard up` default)."""
    schema = TelemetrySchema(prefix=prefix)
    return RedisTelemetryStore(redis_url, schema) if redis_url else InMemoryTelemetryStore(schema)


class FrontendTelemetry:
    ROLES_TTL_S = 1.0  # how long the model -> roles view is reused (the request path reads it)

    def __init__(self, store: TelemetryStore,
                 workers: Callable[[], Iterable[tuple[WorkerInfo, EngineMetrics | None]]] | None = None,
                 interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.workers = workers
        self.clock = clock
        self.aggregator = TelemetryAggregator(store.schema, clock=wall_clock)  # bucket times: epoch seconds (replay: virtual)
        self.flusher = TelemetryFlusher(self.aggregator, store, interval_s, workers)
        self._roles: dict[str, frozenset[str]] = {}
        self._roles_at = -float("inf")

    @classmethod
    def for_pool(cls, store: TelemetryStore, pool, interval_s: float = 1.0) -> FrontendTelemetry:
        """`pool` is the frontend's WorkerPool: its live workers and their last scraped metrics."""
        telemetry = cls(store, lambda: [(w.info, w.metrics) for w in pool.workers.values()], interval_s)
        pool.on_worker_joined.append(lambda live: live.metrics is not None
                                     and telemetry.aggregator.baseline(live.info.worker_id, live.metrics))
        return telemetry

    def roles_of(self, model: str) -> frozenset[str]:
        """Roles of the model's live workers (refreshed at most every ROLES_TTL_S)."""
        now = self.clock()
        if now - self._roles_at >= self.ROLES_TTL_S and self.workers is not None:
            roles: dict[str, set[str]] = {}
            try:
                for info, _ in self.workers():
                    roles.setdefault(info.model, set()).add(info.role.value)
            except Exception:  # a bad worker view must not break the request path: keep the last one
                log.exception("reading the worker roles failed")
            else:
                self._roles = {m: frozenset(r) for m, r in roles.items()}
                self._roles_at = now
        return self._roles.get(model, frozenset())

    def pools_for(self, model: str) -> tuple[str | None, str]:
        """(prefill pool role or None, the pool that decodes) for a request to `model` (rule above)."""
        roles = self.roles_of(model)
        if "prefill" in roles:
            return "prefill", ("decode" if "decode" in roles else "both")
        return None, ("decode" if roles == {"decode"} else "both")

    def on_arrival(self, model: str, role: str | None = None) -> None:
        if role is not None:
            self.aggregator.record_arrival(model, role)
            return
        prefill, decode = self.pools_for(model)
        if prefill is not None:
            self.aggregator.record_arrival(model, prefill)
        self.aggregator.record_arrival(model, decode)

    def on_finish(self, model: str, role: str | None = None, *, ttft_s: float | None, duration_s: float, isl: int, osl: int,
                  ok: bool = True) -> None:
        if role is not None:
            self.aggregator.record_request(model, role, ttft_s=ttft_s, duration_s=duration_s, isl=isl, osl=osl, ok=ok)
            return
        prefill, decode = self.pools_for(model)
        if prefill is not None:  # the prompt's part ends at the first token
            self.aggregator.record_request(model, prefill, ttft_s=ttft_s, duration_s=ttft_s if ttft_s is not None else duration_s,
                                           isl=isl, osl=osl, ok=ok)
        self.aggregator.record_request(model, decode, ttft_s=ttft_s, duration_s=duration_s, isl=isl, osl=osl, ok=ok)

    def start(self) -> None:
        self.flusher.start()

    async def close(self) -> None:
        await self.flusher.close()
