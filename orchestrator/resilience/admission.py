"""Admission control: a bounded queue per model in front of the engines.

    admit(model, key_id, priority, weight)
      1. per-key rate limit (optional hook, e.g. orchestrator.auth's limiter)  -> 429 rate_limit_exceeded
      2. a free slot (in flight < max_inflight), the fleet not saturated and
         nobody queued                                                         -> admitted now
      3. else, if fewer than max_queued are waiting                            -> wait, at most queue_timeout_s
                                                                                  -> 503 + Retry-After
      4. else                                                                  -> 503 + Retry-After at once
    Waiters are granted by priority class (high, normal, low), and within a class by weighted fair share
    across API keys (resilience/fairshare.py: a key's weight and class come from its key record); with
    `fair=False`, in plain FIFO order.

429 means "you, the client, are over your rate"; 503 means "the fleet is full, come back later".

Saturation uses the planner's load-mode signals (planner/load.py: KV-cache usage and waiting
requests per worker, scraped from each engine's /metrics by orchestrator/pool.py): a worker is
saturated when its KV usage >= kv_threshold AND it already has >= queue_threshold requests waiting
(both of the planner's scale-up signals at once: no memory left and requests already queued on the
engine). The fleet of a model is saturated when every ready worker with metrics is saturated; then
sending more requests only lengthens engine queues with no bound, so they wait here instead, in a
queue whose size and wait are bounded. Workers whose metrics are unknown count as not saturated.

The slot is held for the whole request (the stream included) and released by `Ticket.release()`,
which is idempotent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.errors import ServiceUnavailableError
from orchestrator.resilience.fairshare import FairQueue

__all__ = ["AdmissionController", "Ticket", "worker_saturated"]

RateLimiter = Callable[[str | None, str], None]  # (key_id, model) -> None, raises RateLimitError


def worker_saturated(kv_usage: float | None, waiting: float | None, kv_threshold: float, queue_threshold: float) -> bool:
    if kv_usage is None or waiting is None:
        return False
    return kv_usage >= kv_threshold and waiting >= queue_threshold


def _alive(fut: asyncio.Future) -> bool:
    return not fut.done()


@dataclass(slots=True)
class _ModelQueue:
    inflight: int = 0
    waiters: FairQueue = field(default_factory=lambda: FairQueue(alive=_alive))  # of asyncio.Future


class Ticket:
    """An admitted request's slot; release it exactly once (extra calls are ignored)."""

    __slots__ = ("_ctl", "model", "key_id", "queued_s", "_released", "priority")

    def __init__(self, ctl: "AdmissionController", model: str, key_id: str | None, queued_s: float, priority: str = "normal") -> None:
        self._ctl, self.model, self.key_id, self.queued_s, self._released = ctl, model, key_id, queued_s, False
        self.priority = priority

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._ctl._release(self.model)


class AdmissionController:
    def __init__(self, max_inflight: int = 0, max_queued: int = 1024, queue_timeout_s: float = 30.0,
                 retry_after_s: float = 1.0, saturated: Callable[[str], bool] | None = None,
                 recheck_s: float = 0.25, rate_limiter: RateLimiter | None = None,
                 on_reject: Callable[[str, str], None] | None = None,
                 on_queue: Callable[[str, int], None] | None = None, fair: bool = True) -> None:
        self.max_inflight = max_inflight  # 0: no limit on in-flight requests (saturation still applies)
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.saturated = saturated or (lambda model: False)
        self.recheck_s = recheck_s  # how often waiters re-check saturation (it changes with each scrape)
        self.rate_limiter = rate_limiter
        self.on_reject = on_reject or (lambda model, reason: None)
        self.on_queue = on_queue or (lambda model, depth: None)
        self.fair = fair  # priority classes and weighted fair share across keys; False: one FIFO
        self._q: dict[str, _ModelQueue] = {}
        self._pokers: dict[str, asyncio.Task] = {}

    def inflight(self, model: str) -> int:
        q = self._q.get(model)
        return q.inflight if q else 0

    def queued(self, model: str) -> int:
        q = self._q.get(model)
        return len(q.waiters) if q else 0

    def queued_by_class(self) -> dict[str, dict[str, int]]:
        """Per model: waiters per priority class (for /api/cluster and the dashboard)."""
        return {m: q.waiters.depth_by_class() for m, q in self._q.items()}

    def _has_room(self, model: str, q: _ModelQueue) -> bool:
        if self.max_inflight and q.inflight >= self.max_inflight:
            return False
        return not self.saturated(model)

    def _reject(self, model: str, reason: str, message: str) -> ServiceUnavailableError:
        self.on_reject(model, reason)
        return ServiceUnavailableError(message, code="overloaded", retry_after=self.retry_after_s)

    async def admit(self, model: str, key_id: str | None = None, priority: str = "normal", weight: float = 1.0) -> Ticket:
        if self.rate_limiter is not None:
            self.rate_limiter(key_id, model)  # raises RateLimitError (429) for a client over its rate
        q = self._q.get(model)
        if q is None:
            q = self._q[model] = _ModelQueue(waiters=FairQueue(self.fair, _alive))
        if not len(q.waiters) and self._has_room(model, q):
            q.inflight += 1
            return Ticket(self, model, key_id, 0.0, priority)
        if len(q.waiters) >= self.max_queued:
            raise self._reject(model, "queue_full", f"`{model}` is at capacity and {len(q.waiters)} requests are already queued; retry later")
        t0 = time.perf_counter()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        q.waiters.push(fut, key_id, priority, weight)
        self.on_queue(model, len(q.waiters))
        self._ensure_poker(model)
        try:  # the future awaited in this task (no wait_for task, no shield): a grant wakes it on the next loop turn
            async with asyncio.timeout(self.queue_timeout_s):
                await fut
        except TimeoutError:  # the deadline cancelled this task and with it the future, unless it was granted first
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():  # granted in the same instant the deadline fired: hand the slot back
                self._release(model)
            raise self._reject(model, "queue_timeout", f"`{model}` stayed at capacity for {self.queue_timeout_s:g}s; retry later") from None
        except BaseException:  # the client went away while queued
            if fut.done() and not fut.cancelled():
                self._release(model)
            else:
                fut.cancel()
            raise
        finally:
            self._drop_done(q)
            self.on_queue(model, len(q.waiters))
        return Ticket(self, model, key_id, time.perf_counter() - t0, priority)

    def _drop_done(self, q: _ModelQueue) -> None:
        q.waiters.prune()

    def _grant(self, model: str) -> None:
        """Hand free slots to the queue's next waiters (fairshare order) while there is room."""
        q = self._q.get(model)
        if q is None:
            return
        while len(q.waiters) and self._has_room(model, q):
            fut = q.waiters.pop()
            if fut is None:
                break
            q.inflight += 1
            fut.set_result(None)

    def _release(self, model: str) -> None:
        q = self._q.get(model)
        if q is None:
            return
        q.inflight = max(0, q.inflight - 1)
        self._grant(model)

    def _ensure_poker(self, model: str) -> None:
        """While requests wait, re-check saturation periodically (it only changes with engine scrapes)."""
        task = self._pokers.get(model)
        if task is not None and not task.done():
            return

        async def poke() -> None:
            while self.queued(model):
                await asyncio.sleep(self.recheck_s)
                self._grant(model)

        self._pokers[model] = asyncio.create_task(poke())

    async def close(self) -> None:
        for t in self._pokers.values():
            t.cancel()
        await asyncio.gather(*self._pokers.values(), return_exceptions=True)
