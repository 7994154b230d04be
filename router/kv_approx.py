"""Predicted cache contents of one worker that publishes no KV events (approximate mode).

Hashes of requests routed to the worker are kept in time buckets of width ttl/8:

    add(hashes, now)  -> into the newest bucket (a new one when the newest is `width` old)
    expire(now)       -> buckets whose newest possible entry is older than ttl are dropped;
                         returns the hashes that are in no younger bucket (to un-index)
    prune(target)     -> drops oldest buckets (then arbitrary entries) until size() <= target

An entry lives between ttl and ttl + width after the last request that touched it. size() counts
an entry once per bucket holding it, an upper bound of the distinct count. Pure and synchronous.
"""

from __future__ import annotations

from collections import deque

__all__ = ["Predicted"]


class Predicted:
    def __init__(self, ttl_s: float, buckets: int = 8) -> None:
        self.ttl_s = ttl_s
        self.width_s = ttl_s / buckets
        self._buckets: deque[tuple[float, set[int]]] = deque()
        self._size = 0

    def add(self, hashes: list[int], now: float) -> None:
        b = self._buckets
        if not b or now - b[-1][0] >= self.width_s:
            b.append((now, set()))
        s = b[-1][1]
        before = len(s)
        s.update(hashes)
        self._size += len(s) - before

    def size(self) -> int:
        return self._size

    def all(self) -> set[int]:
        out: set[int] = set()
        for _, s in self._buckets:
            out |= s
        return out

    def clear(self) -> None:
        self._buckets.clear()
        self._size = 0

    def expire(self, now: float) -> list[int]:
        b = self._buckets
        if not b or now - b[0][0] < self.ttl_s + self.width_s:
            return []
        old: set[int] = set()
        while b and now - b[0][0] >= self.ttl_s + self.width_s:
            _, s = b.popleft()
            self._size -= len(s)
            old |= s
        return self._unheld(old)

    def prune(self, target: int) -> list[int]:
        b = self._buckets
        old: set[int] = set()
        while len(b) > 1 and self._size > target:
            _, s = b.popleft()
            self._size -= len(s)
            old |= s
        if self._size > target and b:
            s = b[0][1]
            for _ in range(self._size - target):
                old.add(s.pop())
            self._size = len(s)
        return self._unheld(old)

    def _unheld(self, old: set[int]) -> list[int]:
        for _, s in self._buckets:
            old -= s
        return list(old)
