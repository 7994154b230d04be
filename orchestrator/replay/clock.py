"""The replay's virtual clock: a discrete-event queue. No thread, no sleep: time jumps to the next event.

    clock.at(t, fn, *args)      run fn(*args) at virtual time t (>= now); returns a handle for cancel()
    clock.after(dt, fn, *args)  the same at now + dt
    clock.run(until=None)       pop events in order and run them; stops when none is left (or past `until`)

Order: by time, then by priority (lower first; default 0), then first scheduled first. An event scheduled
for the current time from inside a handler runs after every event already queued for that time and
priority. Time never goes backwards: scheduling before `now` raises ValueError. A cancelled event never runs.
`advance(t)` lets a handler run the next event itself when it is due strictly before everything queued.
`clock()` (calling the clock) returns `now`, so it can be handed to anything that takes a
`clock: Callable[[], float]` (the router's load book and prefix index, the telemetry aggregator, the planner).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["VirtualClock"]


class VirtualClock:
    __slots__ = ("now", "_queue", "_seq", "_cancelled", "events_run")

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)
        self._queue: list[tuple[float, int, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self._cancelled: set[int] = set()
        self.events_run = 0

    def __call__(self) -> float:
        return self.now

    def __len__(self) -> int:
        """Events queued (cancelled ones included until they are popped)."""
        return len(self._queue)

    def at(self, t: float, fn: Callable[..., Any], *args: Any, priority: int = 0) -> int:
        if t < self.now:
            raise ValueError(f"cannot schedule at {t} before now ({self.now})")
        seq = next(self._seq)
        heapq.heappush(self._queue, (t, priority, seq, fn, args))
        return seq

    def after(self, dt: float, fn: Callable[..., Any], *args: Any, priority: int = 0) -> int:
        if dt < 0:
            raise ValueError(f"negative delay {dt}")
        return self.at(self.now + dt, fn, *args, priority=priority)

    def cancel(self, handle: int) -> None:
        self._cancelled.add(handle)

    def advance(self, t: float) -> bool:
        """Move to t and count it as an event run, iff t comes strictly before every queued event: the caller then
        runs the event due at t itself (what popping it would do, without the queue). False: nothing changed."""
        q = self._queue
        if t < self.now or (q and t >= q[0][0]):
            return False
        self.now = t
        self.events_run += 1
        return True

    def peek(self) -> float | None:
        """Time of the next event, or None."""
        return self._queue[0][0] if self._queue else None

    def run(self, until: float | None = None) -> None:
        """Run events until none is left, or until the next one lies after `until` (now is then `until`)."""
        queue, pop, cancelled = self._queue, heapq.heappop, self._cancelled
        n = 0
        try:
            while queue:
                if until is not None and queue[0][0] > until:
                    self.now = max(self.now, until)
                    return
                t, _, seq, fn, args = pop(queue)
                if cancelled and seq in cancelled:
                    cancelled.discard(seq)
                    continue
                self.now = t
                n += 1
                fn(*args)
            if until is not None:
                self.now = max(self.now, until)
        finally:
            self.events_run += n
