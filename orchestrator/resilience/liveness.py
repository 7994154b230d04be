"""Hung engines: an engine that accepts connections and never answers (wedged, or SIGSTOPped under a live worker).

    WorkerPool scrapes fail `liveness_failures` times in a row -> HungWorkers.suspect(worker, why)
      confirm   GET the engine's /health (health_probe_timeout_s); an answer clears it (a slow /metrics is no hang)
      trip      its breaker opens now: no new request goes there (resilience/breaker.py)
      fail over what is in flight there (posts awaiting headers are cancelled, responses being read are dropped),
                so the service re-sends or migrates them (service.py) -- only when another routable worker of
                the model exists: otherwise they keep their chance on this one, within their own deadlines

The book of exchanges in flight is kept per worker in weak sets: an exchange that ends simply drops out, and
registering one costs a set insertion per engine send (nothing per token).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
from collections.abc import Awaitable, Callable

__all__ = ["HungWorkers"]

log = logging.getLogger("kvyard.frontend")


class HungWorkers:
    def __init__(self, healthy: Callable[[str], Awaitable[bool]], trip: Callable[[str, str], None],
                 has_alternative: Callable[[str], bool]) -> None:
        self.healthy = healthy  # (worker id) -> its health check passed
        self.trip = trip  # (worker id, why): open its breaker
        self.has_alternative = has_alternative  # (worker id) -> another routable worker of its model exists
        self._inflight: dict[str, weakref.WeakSet] = collections.defaultdict(weakref.WeakSet)
        self._confirming: set[str] = set()

    def book(self, worker_id: str) -> weakref.WeakSet:
        """The worker's exchanges in flight: add a post task or an engine response (anything with `cancel`/`abort`)."""
        return self._inflight[worker_id]

    def forget(self, worker_id: str) -> None:
        self._inflight.pop(worker_id, None)

    def suspect(self, worker_id: str, why: str) -> None:
        """Called by the pool after the failed scrapes; confirms off the caller's path."""
        if worker_id not in self._confirming:
            self._confirming.add(worker_id)
            task = asyncio.create_task(self._confirm(worker_id, why))
            task.add_done_callback(lambda _t: self._confirming.discard(worker_id))

    async def _confirm(self, worker_id: str, why: str) -> None:
        if not await self.healthy(worker_id):
            self.hung(worker_id, f"{why}; its health check failed too")

    def hung(self, worker_id: str, why: str) -> int:
        """Out of routing now, and its exchanges in flight failed over; how many were."""
        self.trip(worker_id, why)
        if not self.has_alternative(worker_id):
            return 0
        moved = 0
        for io in list(self._inflight.pop(worker_id, ())):
            if isinstance(io, asyncio.Future):
                moved += io.cancel()
            else:
                io.abort()
                moved += 1
        if moved:
            log.warning("worker %s is unresponsive: failing over its %d requests in flight", worker_id, moved)
        return moved
