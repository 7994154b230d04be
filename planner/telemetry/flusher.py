"""TelemetryFlusher: the async edge that moves the aggregator's deltas into a TelemetryStore.

Every `interval_s` (default 1 s): take the live worker view (optional `snapshot` callable) as one
gauge sample, drain the aggregator and write the batch in one pipelined call. If the store is
unreachable the batch is merged back into the aggregator (bounded) and retried next round, so a
Redis outage loses nothing short of `max_pending_buckets` (beyond it the oldest buckets are dropped
and counted in `aggregator.dropped_buckets`) and never blocks the request path: the request path only
records into the in-process aggregator. On reconnect the whole backlog goes out in the next round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from planner.telemetry.aggregator import TelemetryAggregator
from planner.telemetry.store import TelemetryStore, TelemetryUnavailableError
from workers.types import EngineMetrics, WorkerInfo

__all__ = ["TelemetryFlusher"]

log = logging.getLogger("kvyard.telemetry")

Snapshot = Callable[[], Iterable[tuple[WorkerInfo, EngineMetrics | None]]]


class TelemetryFlusher:
    def __init__(self, aggregator: TelemetryAggregator, store: TelemetryStore, interval_s: float = 1.0,
                 snapshot: Snapshot | None = None) -> None:
        self.aggregator = aggregator
        self.store = store
        self.interval_s = interval_s
        self.snapshot = snapshot
        self.store_ok = True
        self._task: asyncio.Task | None = None

    async def flush(self) -> bool:
        """One round; True if the store took the batch."""
        if self.snapshot is not None:
            try:
                self.aggregator.record_workers(list(self.snapshot()))
            except Exception:  # a bad snapshot must not stop request telemetry
                log.exception("worker snapshot failed")
        batch = self.aggregator.drain()
        if batch.is_empty():
            return True
        try:
            await self.store.write(batch)
        except TelemetryUnavailableError as exc:
            self.aggregator.restore(batch)
            if self.store_ok:
                log.warning("telemetry store unreachable, keeping up to %d buckets in memory: %s",
                            self.aggregator.max_pending_buckets, exc)
            self.store_ok = False
            return False
        if not self.store_ok:
            log.info("telemetry store reachable again: flushed %d buckets kept during the outage (%d dropped over the bound)",
                     len(batch.buckets), self.aggregator.dropped_buckets)
        self.store_ok = True
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except Exception:  # the loop must outlive any one bad round
                log.exception("telemetry flush failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Stop the loop and make one last flush."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.flush()
        except Exception:
            log.exception("final telemetry flush failed")
