"""Predicted load per endpoint, kept by the router itself.

Every routed request adds to its endpoint's in-flight count, its prefill tokens (the prompt tokens
not already cached there: prompt_tokens - cached_tokens) and its active blocks (all of its prompt
blocks, cached or not: they are all read while it decodes);
the first token removes its prefill tokens; completion (success, error or cancel) removes the rest.
Requests never completed expire after `ttl_s` (default 300 s, as Dynamo) so a lost callback cannot
leave a worker looking busy forever. Pure and synchronous; the caller supplies the clock (`clock`, default
time.monotonic; the replay passes its virtual one, orchestrator/replay/).

Prefill drain (`drain=True`): booked prefill is the work a worker had when the request came, not what it
has now. A worker 3 s into a 4 s prompt is almost free, yet until that first token it looks as loaded
as when the prompt arrived, so the router avoids it for the whole prefill (Dynamo's bookkeeping, and
ours without drain). With drain, each worker's prompts awaiting their first token form a FCFS queue (the
engines schedule waiting prefills first come, first served: vLLM, SGLang, the sim) that `advance(now)`
drains at the worker's measured prefill rate, front first; `prefill_tokens` is then the estimated
remaining prefill. The rate is learned from the worker's own first tokens: over each busy spell (some
prompt awaiting its first token), the booked tokens of the prompts whose first token came back over the
time they took, as exponentially weighted sums (so a short prompt finishing in the same step as a long
one does not read as an absurd rate). A first token also ends the prefill of every prompt routed there
before it (FCFS: they are done). Until a worker's first sample its queue does not drain (the booked
figure, as without drain). Estimates only shrink what is booked: completion still releases exactly
what was booked, so an error in the rate can never leave a worker looking loaded forever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from router.config import KV_DEFAULTS
from router.types import EndpointLoad

__all__ = ["LoadTracker"]


@dataclass(slots=True, eq=False)
class _Active:
    worker_id: str
    prefill_tokens: int  # booked: the uncached prompt tokens, until the first token (then 0)
    blocks: int
    started: float
    remaining: float = 0.0  # drain: the part of prefill_tokens still counted in the worker's load
    seq: int = 0  # drain: its place in the worker's FCFS order


@dataclass(slots=True)
class _Drain:
    """One worker's prompts awaiting their first token (FCFS, by seq) and its measured prefill rate.

    Entries move from `queue` (still counted in the load) to `drained` when advance() estimates them done, and
    leave both at a first token (theirs or a later one's): advance() walks only what it drains, never the
    prompts it already counted done, however many await their first token."""

    queue: deque = field(default_factory=deque)  # _Active entries with remaining > 0 (or ended early), by seq
    drained: deque = field(default_factory=deque)  # estimated done, first token not seen yet, by seq
    next_seq: int = 0
    busy_since: float = 0.0  # start of the current service interval (a prompt arrived at an idle queue, or a first token)
    last: float = 0.0  # when advance() last drained this queue
    tokens: float = 0.0  # exponentially weighted sums of tokens served and of the time serving them
    seconds: float = 0.0


# weight of the past in the rate's sums, per sample: ~the last 20 first tokens count
RATE_DECAY = 0.95
ADVANCE_EVERY_S = 0.002


class LoadTracker:
    def __init__(self, ttl_s: float = 300.0, drain: bool = KV_DEFAULTS.prefill_drain,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.drain = drain
        self.clock = clock
        self._active: dict[str, _Active] = {}
        self._loads: dict[str, EndpointLoad] = {}
        self._drains: dict[str, _Drain] = {}
        self._advanced = float("-inf")

    def load(self, worker_id: str) -> EndpointLoad:
        ld = self._loads.get(worker_id)
        if ld is None:
            ld = self._loads[worker_id] = EndpointLoad()
        return ld

    def peek(self, worker_id: str) -> EndpointLoad | None:
        """The worker's load if anything was ever booked on it (no entry is created)."""
        return self._loads.get(worker_id)

    def booked(self) -> Mapping[str, EndpointLoad]:
        """Every worker's load by id, live (not a copy): the router merges it into endpoints on its hot path."""
        return self._loads

    def on_routed(
        self, request_id: str, worker_id: str, prompt_tokens: int, block_size: int, now: float | None = None, cached_tokens: int = 0
    ) -> None:
        if request_id in self._active:
            self.on_complete(request_id)
        blocks = -(-prompt_tokens // max(block_size, 1))
        prefill = max(0, prompt_tokens - cached_tokens)
        now = self.clock() if now is None else now
        act = self._active[request_id] = _Active(worker_id, prefill, blocks, now, float(prefill))
        ld = self.load(worker_id)
        ld.inflight_requests += 1
        ld.prefill_tokens += prefill
        ld.active_blocks += blocks
        if self.drain and prefill:
            dr = self._drains.get(worker_id)
            if dr is None:
                dr = self._drains[worker_id] = _Drain(last=now)
            if not dr.queue and not dr.drained:
                dr.busy_since = dr.last = now  # an idle worker starts serving this prompt now
            act.seq = dr.next_seq
            dr.next_seq += 1
            dr.queue.append(act)

    def on_first_token(self, request_id: str, now: float | None = None) -> None:
        act = self._active.get(request_id)
        if act is None or act.prefill_tokens == 0:
            return
        if self.drain:
            self._departed(act, self.clock() if now is None else now)
            return
        self.load(act.worker_id).prefill_tokens -= act.prefill_tokens
        act.prefill_tokens = 0

    def on_complete(self, request_id: str) -> None:
        act = self._active.pop(request_id, None)
        if act is None:
            return
        ld = self.load(act.worker_id)
        ld.inflight_requests -= 1
        ld.active_blocks -= act.blocks
        if act.prefill_tokens:  # ended before its first token (error, cancel, failover)
            ld.prefill_tokens -= act.remaining if self.drain else act.prefill_tokens
            act.prefill_tokens = 0
            act.remaining = 0.0
            if self.drain:
                self._settle(act.worker_id)

    # ---- prefill drain ----------------------------------------------------------------------------------------

    def prefill_rate(self, worker_id: str) -> float | None:
        """Measured prefill tokens per second of the worker (drain), None before its first sample."""
        dr = self._drains.get(worker_id)
        return dr.tokens / dr.seconds if dr is not None and dr.seconds > 0 else None

    def advance(self, now: float | None = None) -> None:
        """Drain every worker's FCFS prefill queue by what its measured rate served since the last call."""
        if not self.drain:
            return
        now = self.clock() if now is None else now
        if now - self._advanced < ADVANCE_EVERY_S:  # the router calls this per decision: at most every 2 ms
            return
        self._advanced = now
        loads = self._loads
        for wid, dr in self._drains.items():
            q = dr.queue
            dt = now - dr.last
            dr.last = now
            if not q or dt <= 0 or dr.seconds <= 0:
                continue
            budget = dr.tokens / dr.seconds * dt
            ld = loads[wid]
            drained = dr.drained
            while q and budget > 0:
                act = q[0]
                r = act.remaining
                if r > budget:
                    act.remaining = r - budget
                    ld.prefill_tokens -= budget
                    break
                act.remaining = 0.0
                budget -= r
                ld.prefill_tokens -= r
                drained.append(q.popleft())
            if not q:
                ld.prefill_tokens = 0  # every prompt there estimated done: no float drift

    def _departed(self, act: _Active, now: float) -> None:
        """`act`'s first token: it and every prompt routed to its worker before it are done with prefill."""
        dr = self._drains.get(act.worker_id)
        ld = self.load(act.worker_id)
        if dr is None:  # its worker was removed meanwhile
            act.prefill_tokens, act.remaining = 0, 0.0
            return
        served = 0
        for q in (dr.drained, dr.queue):  # every entry up to act's seq: drained ones come first
            while q and q[0].seq <= act.seq:
                a = q.popleft()
                served += a.prefill_tokens
                ld.prefill_tokens -= a.remaining
                a.prefill_tokens, a.remaining = 0, 0.0
        spent = now - dr.busy_since
        if served and spent > 0:
            dr.tokens = dr.tokens * RATE_DECAY + served
            dr.seconds = dr.seconds * RATE_DECAY + spent
        dr.busy_since = dr.last = now
        self._settle(act.worker_id)

    def _settle(self, worker_id: str) -> None:
        """Drop finished entries from the queue's front; an empty queue holds no estimate (no float drift)."""
        dr = self._drains.get(worker_id)
        if dr is None:
            return
        for q in (dr.drained, dr.queue):
            while q and q[0].prefill_tokens == 0:
                q.popleft()
        if not dr.queue:
            self.load(worker_id).prefill_tokens = 0

    def expire(self, now: float | None = None) -> int:
        """Drop requests older than ttl_s; returns how many were dropped."""
        now = self.clock() if now is None else now
        stale = [rid for rid, a in self._active.items() if now - a.started > self.ttl_s]
        for rid in stale:
            self.on_complete(rid)
        return len(stale)

    def remove_worker(self, worker_id: str) -> None:
        for rid in [rid for rid, a in self._active.items() if a.worker_id == worker_id]:
            del self._active[rid]
        self._loads.pop(worker_id, None)
        self._drains.pop(worker_id, None)
