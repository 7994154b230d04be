"""The admission queue's order: priority classes first, then weighted fair share across API keys in a class.

    classes   high > normal > low: a waiter of a higher class is always granted before any of a lower one
    in a class, start-time fair queuing over keys (Goyal et al., SFQ), each request one unit of service:
        on push(key, weight):   start  = max(V, finish[key]);   finish[key] = start + 1 / weight
        pop:                    the waiter with the smallest start (ties: arrival order);  V = that start

So a key with weight w is granted w slots for every slot of a weight-1 key while both have waiters, whatever
either has queued: a key that floods the queue with 1,000 requests gets tags V, V+1, V+2, ..., and a polite
key's next request, tagged max(V, its last finish) = about V, goes before nearly all of them. A key that was idle
does not bank credit (its start is at least V). Requests without a key share one key (None). With fair share
off (`fair=False`) every waiter is in one class and one key: plain FIFO, the queue as it was.

Strict priority means a lower class waits as long as a higher one has waiters: under an overload made of high
requests, low ones wait until the admission timeout (503) rather than taking slots from high ones.
Pure and synchronous; removal of a waiter that gave up is lazy (its entry is skipped when popped).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PRIORITY_CLASSES", "FairQueue", "FairShareConfig", "priority_rank"]


class FairShareConfig(BaseModel):
    """Order of the admission queue (YAML `frontend.fair_share`); keys carry the class and weight."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="grant queued requests by priority class, then weighted fair share across keys; off: FIFO")
    engine_priority: bool = Field(False, description="also send each key's class as the engine's own `priority` field "
                                                     "(vLLM needs --scheduling-policy priority, SGLang --enable-priority-scheduling)")

PRIORITY_CLASSES = ("high", "normal", "low")  # served in this order
_RANK = {name: i for i, name in enumerate(PRIORITY_CLASSES)}

T = TypeVar("T")


def priority_rank(name: str) -> int:
    """0 for the class served first; ValueError for an unknown class."""
    try:
        return _RANK[name]
    except KeyError:
        raise ValueError(f"unknown priority class {name!r}; known: {', '.join(PRIORITY_CLASSES)}") from None


class _Class:
    __slots__ = ("heap", "vtime", "finish", "live")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Any]] = []
        self.vtime = 0.0
        self.finish: dict[Any, float] = {}
        self.live = 0


class FairQueue(Generic[T]):
    def __init__(self, fair: bool = True, alive: Callable[[T], bool] = lambda item: True) -> None:
        """`alive(item)`: False for a waiter that gave up (skipped and dropped when reached)."""
        self.fair = fair
        self.alive = alive
        self._classes = [_Class() for _ in PRIORITY_CLASSES]
        self._seq = itertools.count()

    def push(self, item: T, key: Any = None, priority: str = "normal", weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError("weight must be > 0")
        rank = priority_rank(priority) if self.fair else _RANK["normal"]
        c = self._classes[rank]
        if not self.fair:
            key, weight = None, 1.0
        start = max(c.vtime, c.finish.get(key, 0.0))
        c.finish[key] = start + 1.0 / weight
        heapq.heappush(c.heap, (start, next(self._seq), item))
        c.live += 1

    def pop(self) -> T | None:
        """The next live waiter, or None when there is none."""
        for c in self._classes:
            while c.heap:
                start, _, item = heapq.heappop(c.heap)
                c.live -= 1
                if not self.alive(item):
                    continue
                c.vtime = start
                if not c.heap:  # idle class: forget per-key finish tags so they cannot grow without bound
                    c.finish.clear()
                return item
        return None

    def prune(self) -> None:
        """Drop waiters that gave up (call now and then; pop skips them anyway)."""
        for c in self._classes:
            kept = [e for e in c.heap if self.alive(e[2])]
            if len(kept) != len(c.heap):
                heapq.heapify(kept)
                c.heap, c.live = kept, len(kept)

    def __len__(self) -> int:
        return sum(c.live for c in self._classes)

    def depth_by_class(self) -> dict[str, int]:
        """Waiters per priority class (those that gave up but are not pruned yet included)."""
        return {name: self._classes[i].live for i, name in enumerate(PRIORITY_CLASSES)}
