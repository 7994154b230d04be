"""Predicted load per endpoint, kept by the router itself.

Every routed request adds to its endpoint's in-flight count, its prefill tokens (the prompt tokens
not already cached there: prompt_tokens - cached_tokens) and its active blocks (all of its prompt
blocks, cached or not: they are all read while it decodes);
the first token removes its prefill tokens; completion (success, error or cancel) removes the rest.
Requests never completed expire after `ttl_s` (default 300 s, as Dynamo) so a lost callback cannot
leave a worker looking busy forever. Pure and synchronous; the caller supplies the clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from router.types import EndpointLoad

__all__ = ["LoadTracker"]


@dataclass(slots=True)
class _Active:
    worker_id: str
    prefill_tokens: int
    blocks: int
    started: float


class LoadTracker:
    def __init__(self, ttl_s: float = 300.0) -> None:
        self.ttl_s = ttl_s
        self._active: dict[str, _Active] = {}
        self._loads: dict[str, EndpointLoad] = {}

    def load(self, worker_id: str) -> EndpointLoad:
        ld = self._loads.get(worker_id)
        if ld is None:
            ld = self._loads[worker_id] = EndpointLoad()
        return ld

    def peek(self, worker_id: str) -> EndpointLoad | None:
        """The worker's load if anything was ever booked on it (no entry is created)."""
        return self._loads.get(worker_id)  # Router binds self._loads.get directly on its hot path

    def on_routed(
        self, request_id: str, worker_id: str, prompt_tokens: int, block_size: int, now: float | None = None, cached_tokens: int = 0
    ) -> None:
        if request_id in self._active:
            self.on_complete(request_id)
        blocks = -(-prompt_tokens // max(block_size, 1))
        prefill = max(0, prompt_tokens - cached_tokens)
        self._active[request_id] = _Active(worker_id, prefill, blocks, time.monotonic() if now is None else now)
        ld = self.load(worker_id)
        ld.inflight_requests += 1
        ld.prefill_tokens += prefill
        ld.active_blocks += blocks

    def on_first_token(self, request_id: str) -> None:
        act = self._active.get(request_id)
        if act is None or act.prefill_tokens == 0:
            return
        self.load(act.worker_id).prefill_tokens -= act.prefill_tokens
        act.prefill_tokens = 0

    def on_complete(self, request_id: str) -> None:
        act = self._active.pop(request_id, None)
        if act is None:
            return
        ld = self.load(act.worker_id)
        ld.inflight_requests -= 1
        ld.prefill_tokens -= act.prefill_tokens
        ld.active_blocks -= act.blocks

    def expire(self, now: float | None = None) -> int:
        """Drop requests older than ttl_s; returns how many were dropped."""
        now = time.monotonic() if now is None else now
        stale = [rid for rid, a in self._active.items() if now - a.started > self.ttl_s]
        for rid in stale:
            self.on_complete(rid)
        return len(stale)

    def remove_worker(self, worker_id: str) -> None:
        for rid in [rid for rid, a in self._active.items() if a.worker_id == worker_id]:
            del self._active[rid]
        self._loads.pop(worker_id, None)
