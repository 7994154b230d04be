"""The free-block queue: vLLM's `FreeKVCacheBlockQueue`, a doubly linked list over block ids.

Front = next block to allocate (and evict). O(1) `popleft`, `append` (back), `appendleft` (front)
and `remove` (a prefix hit takes a cached block off the queue), with no rehashing: the links are two
flat int lists indexed by block id, plus one sentinel node (id = num_blocks) closing the ring.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["FreeBlockQueue"]


class FreeBlockQueue:
    def __init__(self, num_blocks: int, initial: Iterable[int] = ()) -> None:
        s = self._sentinel = num_blocks
        self._next = [-1] * (num_blocks + 1)
        self._prev = [-1] * (num_blocks + 1)
        self._next[s] = self._prev[s] = s
        self._in = [False] * num_blocks
        self._len = 0
        order = list(initial)
        if order and len(set(order)) == len(order) and all(0 <= b < num_blocks for b in order):  # link them in one pass
            nxt, prv = self._next, self._prev
            for a, b in zip([s] + order, order + [s]):
                nxt[a] = b
                prv[b] = a
            for b in order:
                self._in[b] = True
            self._len = len(order)
        else:
            for b in order:
                self.append(b)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, b: int) -> bool:
        return self._in[b]

    def __iter__(self) -> Iterator[int]:
        nxt, b = self._next, self._next[self._sentinel]
        while b != self._sentinel:
            yield b
            b = nxt[b]

    def _link(self, b: int, before: int) -> None:
        prev = self._prev[before]
        self._next[prev] = b
        self._prev[b] = prev
        self._next[b] = before
        self._prev[before] = b
        self._in[b] = True
        self._len += 1

    def append(self, b: int) -> None:
        self._link(b, self._sentinel)

    def appendleft(self, b: int) -> None:
        self._link(b, self._next[self._sentinel])

    def remove(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        self._next[p] = n
        self._prev[n] = p
        self._in[b] = False
        self._len -= 1

    def popleft(self) -> int:
        if not self._len:
            raise IndexError("no free blocks")
        b = self._next[self._sentinel]
        self.remove(b)
        return b
