"""Per-worker circuit breakers and jittered retry backoff.

A worker that keeps failing is taken out of routing and brought back by a health check, so one
flapping engine cannot eat every request's retry budget (the peers' failure mode: a dead pod that
still answers TCP keeps being picked until its lease lapses).

    CLOSED ──(failure_threshold consecutive failures)──> OPEN ──(cooldown elapsed)──> HALF_OPEN
       ^                                                   ^                              │
       └──────────── GET /health answers 200 ──────────────┼──────────────────────────────┤
                                                           └── probe fails: cooldown x2 ──┘

- A failure is a connection error, a 5xx, a timeout, or a stream that broke mid-way; a success is a
  request that completed (a 4xx is a success: the engine is alive and answered).
- `trip` opens it at once: the pool calls it (through the service) when an engine failed
  `liveness_failures` metric scrapes in a row (a hung engine: it accepts connections and never
  answers), and the service then fails over the requests in flight there.
- OPEN and HALF_OPEN workers are skipped by routing. In HALF_OPEN the probe loop sends one
  GET /health (a short deadline); 200 closes the breaker, anything else re-opens it with the
  cooldown doubled (capped at max_open_s).
- Workers that leave the pool are forgotten (`prune`).

`backoff_s(attempt)` is exponential backoff with full jitter (AWS architecture blog, "Exponential
Backoff And Jitter"): uniform(0, min(cap, base * 2**attempt)), so retries from many requests that
failed together do not arrive together.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["BreakerState", "Breaker", "BreakerBoard", "backoff_s"]

log = logging.getLogger("kvyard.breaker")


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Delay before retry number `attempt` (1 = the first retry): full jitter in [0, min(cap, base·2^(attempt-1))]."""
    if attempt <= 0 or base_s <= 0:
        return 0.0
    ceiling = min(cap_s, base_s * (2 ** (attempt - 1)))
    return (rng or random).uniform(0.0, ceiling)


@dataclass(slots=True)
class Breaker:
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0  # consecutive
    open_until: float = 0.0
    cooldown_s: float = 0.0
    probing: bool = False


class BreakerBoard:
    """The breakers of all workers, and the loop that health-checks the open ones.

    `probe(worker_id) -> bool` performs the health check (GET /health); `on_change(worker_id, state)`
    is told of every transition (metrics, logs).
    """

    def __init__(self, failure_threshold: int = 3, open_s: float = 5.0, max_open_s: float = 60.0,
                 probe: Callable[[str], Awaitable[bool]] | None = None,
                 on_change: Callable[[str, BreakerState], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.max_open_s = max_open_s
        self.probe = probe
        self.on_change = on_change
        self.clock = clock
        self._b: dict[str, Breaker] = {}
        self._task: asyncio.Task | None = None

    # ---- queries -----------------------------------------------------------------------------

    def state(self, worker_id: str) -> BreakerState:
        b = self._b.get(worker_id)
        return b.state if b else BreakerState.CLOSED

    def allows(self, worker_id: str) -> bool:
        """Routing may pick this worker (its breaker is closed)."""
        return self.state(worker_id) == BreakerState.CLOSED

    def retry_after_s(self) -> float:
        """Seconds until the soonest open breaker will be probed (for a 503's Retry-After)."""
        now = self.clock()
        waits = [max(0.0, b.open_until - now) for b in self._b.values() if b.state != BreakerState.CLOSED]
        return min(waits, default=0.0)

    def snapshot(self) -> dict[str, str]:
        return {w: b.state.name.lower() for w, b in self._b.items()}

    # ---- outcomes ----------------------------------------------------------------------------

    def success(self, worker_id: str) -> None:
        b = self._b.get(worker_id)
        if b is None:
            return
        b.failures = 0
        if b.state != BreakerState.CLOSED:  # a request that was in flight when it opened came back fine
            self._close(worker_id, b, "a request completed")

    def failure(self, worker_id: str, reason: str = "") -> None:
        b = self._b.setdefault(worker_id, Breaker())
        b.failures += 1
        if b.state == BreakerState.CLOSED and b.failures >= self.failure_threshold:
            b.cooldown_s = self.open_s
            self._open(worker_id, b, f"{b.failures} consecutive failures (last: {reason})")

    def trip(self, worker_id: str, reason: str) -> None:
        """Open the breaker now, whatever the count (the worker stopped answering its scrapes: a hung engine)."""
        b = self._b.setdefault(worker_id, Breaker())
        b.failures = max(b.failures, self.failure_threshold)
        if b.state == BreakerState.CLOSED:
            b.cooldown_s = self.open_s
            self._open(worker_id, b, reason)

    def prune(self, live: set[str]) -> None:
        for wid in [w for w in self._b if w not in live]:
            del self._b[wid]

    # ---- transitions -------------------------------------------------------------------------

    def _set(self, worker_id: str, b: Breaker, state: BreakerState) -> None:
        b.state = state
        if self.on_change is not None:
            self.on_change(worker_id, state)

    def _open(self, worker_id: str, b: Breaker, why: str) -> None:
        b.open_until = self.clock() + b.cooldown_s
        log.warning("breaker of %s OPEN for %.1fs: %s", worker_id, b.cooldown_s, why)
        self._set(worker_id, b, BreakerState.OPEN)

    def _close(self, worker_id: str, b: Breaker, why: str) -> None:
        b.failures = 0
        b.cooldown_s = 0.0
        log.info("breaker of %s CLOSED: %s", worker_id, why)
        self._set(worker_id, b, BreakerState.CLOSED)

    async def probe_due(self) -> None:
        """Health-check every open breaker whose cooldown has elapsed (one probe each at a time)."""
        now = self.clock()
        due = [(w, b) for w, b in self._b.items() if b.state == BreakerState.OPEN and now >= b.open_until and not b.probing]
        await asyncio.gather(*(self._probe_one(w, b) for w, b in due))

    async def _probe_one(self, worker_id: str, b: Breaker) -> None:
        self._set(worker_id, b, BreakerState.HALF_OPEN)
        b.probing = True
        try:
            ok = bool(await self.probe(worker_id)) if self.probe is not None else False
        except Exception as exc:  # a probe error is a failed probe, never a crash of the loop
            log.debug("probe of %s raised %s", worker_id, exc)
            ok = False
        finally:
            b.probing = False
        if self._b.get(worker_id) is not b or b.state != BreakerState.HALF_OPEN:
            return  # forgotten or already closed by a completed request meanwhile
        if ok:
            self._close(worker_id, b, "health check passed")
        else:
            b.cooldown_s = min(self.max_open_s, max(self.open_s, b.cooldown_s * 2))
            self._open(worker_id, b, "health check failed")

    # ---- the loop ----------------------------------------------------------------------------

    def start(self, interval_s: float) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.probe_due()
                except Exception:  # the loop must outlive any one round
                    log.exception("breaker probe round failed")

        self._task = asyncio.create_task(loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
