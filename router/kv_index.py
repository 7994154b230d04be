"""The prefix index: which workers hold which prefix blocks. Pure and synchronous.

    owners : our chained block hash -> bitmask of worker slots holding it (router._kvcore.MaskTable)
    worker : slot, bit = 1 << slot, and
             blocks    engine block id -> our hash (any engine's hash algorithm; ids stay opaque)
             extra     our hash -> further engine ids mapping to it (salted duplicates; rare)
             predicted approximate mode only: routed-to hashes in time buckets (router/kv_approx.py)

Because each chained hash names its whole prefix (router/hashing.py), matching is a walk over the
request's hashes: `find_matches(h) = {worker: number of consecutive blocks from the start it holds}`,
AND-ing the owner masks and stopping as soon as no worker is left (MaskTable.match, in C).

Events (engine-neutral, router/kv_events.py):
    BlockStored(block_hashes, parent, token_ids, block_size, lora_name, mm_keys)
        our hashes = block_hashes(token_ids, block_size, lora_name, parent=blocks[parent]), with each block's
        multimodal keys mixed in when it has any (router/mm_hashing.py);
        a parent id the worker never stored is rejected (as Dynamo does): its chain is unknown.
    BlockRemoved(block_hashes)      engine ids the worker never stored are ignored.
    AllBlocksCleared / remove_worker   drop exactly that worker's entries.
Only the GPU tier (medium None or "GPU") is indexed; offload tiers are ignored. A rejected event
raises KvEventRejected and leaves the index exactly as it was. Store and remove cost a few dict
operations per block, done in C batches (measured in benchmarks/router_micro.py).

Pending predictions (event-fed workers): a request's blocks are cached on its worker only once its prefill has run
and the engine's BlockStored events have come back, so a burst of requests on one prefix would all see the
same single holder. `record_routed` therefore also marks the blocks a routed request will store (those past
what the worker already holds) as pending there, in a second table (`pending`) that matching ORs into the
owners, for `pending_ttl_s` (default 10 s, 0: off; entries go in batches, between 1 and 1.25 TTL old; at most
`approx_max_blocks` per worker, oldest dropped first). The events confirm them in the owners table long before;
a request that fails leaves a stale prediction for at most that long. A worker's clear or removal drops its
predictions too.

Workers with no event source run in approximate mode: `record_routed` (called by the router at
booking time) predicts that the request's blocks are now cached there, for `approx_ttl_s`
(default 120 s, as Dynamo) and at most `approx_max_blocks` per worker (default 2^17, pruned to
0.8 of that, oldest first). A worker the index has never heard of is put in approximate mode on
its first routed request, with a warning; an event-fed worker that has had `silent_warn_after`
(default 50) requests routed to it and published no event at all gets a warning too.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import repeat

from router._kernels import MaskTable
from router.config import KV_DEFAULTS
from router.errors import BlockHashError, KvEventRejected
from router.hashing import block_hashes
from router.mm_hashing import mm_block_hashes
from router.kv_approx import Predicted
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["KvIndex"]

log = logging.getLogger("kvyard.router.kv_index")

_GPU = (None, "GPU", "gpu")


@dataclass(slots=True, eq=False)
class _Worker:
    worker_id: str
    slot: int
    block_size: int | None = None
    blocks: dict[int, int] = field(default_factory=dict)
    extra: dict[int, int] = field(default_factory=dict)
    predicted: Predicted | None = None
    pending: deque = field(default_factory=deque)  # (expires_at, hashes) of routed requests, oldest first
    pending_size: int = 0  # hashes in `pending`, counted once per request
    events: int = 0
    routed: int = 0


class KvIndex:
    def __init__(
        self,
        approx_ttl_s: float = 120.0,
        approx_max_blocks: int = 1 << 17,
        approx_prune_ratio: float = 0.8,
        auto_approximate: bool = True,
        silent_warn_after: int = 50,
        clock: Callable[[], float] = time.monotonic,
        pending_ttl_s: float = KV_DEFAULTS.pending_ttl_s,
    ) -> None:
        self.approx_ttl_s = approx_ttl_s
        self.approx_max_blocks = approx_max_blocks
        self.approx_prune_ratio = approx_prune_ratio
        self.auto_approximate = auto_approximate
        self.silent_warn_after = silent_warn_after
        self.clock = clock
        self.pending_ttl_s = pending_ttl_s
        self._owners = MaskTable()
        self._pending = MaskTable()  # our hash -> workers with a routed request whose blocks no event has confirmed yet
        self._workers: dict[str, _Worker] = {}
        self._by_slot: list[_Worker | None] = []
        self._free: list[int] = []

    # ---- workers -----------------------------------------------------------------------------

    def add_worker(self, worker_id: str, approximate: bool = False, block_size: int | None = None) -> None:
        """Register a worker (idempotent). Switching mode drops what the other mode knew."""
        w = self._workers.get(worker_id)
        if w is None:
            slot = heapq.heappop(self._free) if self._free else len(self._by_slot)
            w = _Worker(worker_id, slot)
            if slot == len(self._by_slot):
                self._by_slot.append(w)
            else:
                self._by_slot[slot] = w
            self._workers[worker_id] = w
        elif approximate != (w.predicted is not None):
            self.clear_worker(worker_id)
        if block_size is not None:
            w.block_size = block_size
        if approximate and w.predicted is None:
            w.predicted = Predicted(self.approx_ttl_s)
            log.warning(
                "worker %s: no KV events (none published, or none subscribed to): routing to it on PREDICTED "
                "cache contents only (approximate mode, TTL %.0f s); enable the engine's KV events for exact prefix routing",
                worker_id, self.approx_ttl_s,
            )
        elif not approximate:
            w.predicted = None

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every entry it had; its slot is reused later."""
        if worker_id not in self._workers:
            return
        self.clear_worker(worker_id)
        w = self._workers.pop(worker_id)
        self._by_slot[w.slot] = None
        heapq.heappush(self._free, w.slot)

    def clear_worker(self, worker_id: str) -> None:
        """Drop all of a worker's entries (AllBlocksCleared, a gap nothing can replay, a restart)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        self._owners.remove(list(w.blocks.values()), w.slot)
        w.blocks.clear()
        w.extra.clear()
        if w.predicted is not None:
            self._owners.remove(list(w.predicted.all()), w.slot)
            w.predicted.clear()
        for _, hashes in w.pending:
            self._pending.remove(hashes, w.slot)
        w.pending.clear()
        w.pending_size = 0

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def is_approximate(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.predicted is not None

    def event_fed(self, worker_id: str) -> bool:
        """A known worker whose entries come from its KV events (not predicted from what was routed to it)."""
        w = self._workers.get(worker_id)
        return w is not None and w.predicted is None

    def tree_sizes(self) -> dict[str, int]:
        """Distinct prefix blocks indexed per worker."""
        return {
            wid: len(w.blocks) - sum(w.extra.values()) + (w.predicted.size() if w.predicted else 0)
            for wid, w in self._workers.items()
        }

    def __len__(self) -> int:
        """Distinct block hashes indexed (over all workers; pending predictions not counted)."""
        return len(self._owners)

    def pending_blocks(self) -> int:
        """Distinct block hashes pending on some worker (routed there, not yet confirmed by its events)."""
        return len(self._pending)

    @property
    def nbytes(self) -> int:
        """Memory held by the hash -> workers table (not counting the per-worker id maps)."""
        return self._owners.nbytes

    # ---- events ------------------------------------------------------------------------------

    def apply(self, worker_id: str, event: KvEvent) -> int:
        """Apply one event from `worker_id`; returns the number of blocks it touched.

        Raises KvEventRejected (index unchanged) for an event that cannot be applied.
        """
        if isinstance(event, BlockStored):
            if event.medium not in _GPU:
                return 0
            return self.store(worker_id, event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, event.lora_name,
                              event.mm_keys)
        if isinstance(event, BlockRemoved):
            return 0 if event.medium not in _GPU else self.remove(worker_id, event.block_hashes, event.events)
        if isinstance(event, AllBlocksCleared):
            self._event_worker(worker_id)
            self.clear_worker(worker_id)
            return 0
        raise KvEventRejected(f"unknown event type {type(event).__name__}")

    def apply_batch(self, worker_id: str, events: Iterable[KvEvent]) -> list[KvEventRejected]:
        """Apply events in order; a rejected one is skipped and returned, the rest still apply.

        vLLM publishes one BlockRemoved per evicted block, so a batch under memory pressure holds runs of
        one-hash removals. The vLLM and SGLang typed decoders merge them already (router.kv_events.removal_runs);
        what is left here (their generic paths, TensorRT-LLM's events, a malformed id among them) is merged the same
        way: a run of consecutive GPU removals is applied as one removal of all their hashes: the same index after
        it (removals commute with each other), counted as as many events, at a fraction of the per-event cost
        (benchmarks/kv_ingest.py, workload `evict`)."""
        rejected: list[KvEventRejected] = []
        run: list[BlockRemoved] = []
        for ev in events:
            if type(ev) is BlockRemoved and ev.medium in _GPU:
                run.append(ev)
                continue
            if run:
                self._remove_run(worker_id, run, rejected)
                run = []
            try:
                self.apply(worker_id, ev)
            except KvEventRejected as exc:
                rejected.append(exc)
        if run:
            self._remove_run(worker_id, run, rejected)
        return rejected

    def _remove_run(self, worker_id: str, run: list[BlockRemoved], rejected: list[KvEventRejected]) -> None:
        if len(run) > 1:
            try:
                self.remove(worker_id, [h for ev in run for h in ev.block_hashes], events=sum(ev.events for ev in run))
                return
            except KvEventRejected:
                pass  # one of them is malformed: apply them one by one, so only that one is rejected
        for ev in run:
            try:
                self.remove(worker_id, ev.block_hashes, ev.events)
            except KvEventRejected as exc:
                rejected.append(exc)

    def store(self, worker_id: str, engine_hashes: list[int], parent: int | None, token_ids, block_size: int, lora_name: str | None = None,
              mm_keys: list | None = None) -> int:
        n = len(engine_hashes)
        if not isinstance(block_size, int) or block_size < 1:
            raise KvEventRejected(f"BlockStored from {worker_id}: block_size {block_size!r} is not a positive int")
        if len(token_ids) != n * block_size:
            raise KvEventRejected(f"BlockStored from {worker_id}: {len(token_ids)} tokens for {n} blocks of {block_size}")
        w = self._event_worker(worker_id)
        if n == 0:
            return 0
        if w.block_size is not None and block_size != w.block_size:
            raise KvEventRejected(f"BlockStored from {worker_id}: block_size {block_size}, but the worker registered {w.block_size}")
        blocks = w.blocks
        ours_parent = None
        if parent is not None:
            ours_parent = blocks.get(parent) if isinstance(parent, int) else None
            if ours_parent is None:
                raise KvEventRejected(f"BlockStored from {worker_id}: parent block {parent} was never stored there")
        try:
            if mm_keys:
                ours = mm_block_hashes(token_ids, block_size, lora_name, mm_keys, ours_parent)
            else:
                ours = block_hashes(token_ids, block_size, lora_name, ours_parent)
        except BlockHashError as exc:
            raise KvEventRejected(f"BlockStored from {worker_id}: {exc}") from exc
        try:
            fresh = blocks.keys().isdisjoint(engine_hashes)
        except TypeError as exc:  # unhashable ids
            raise KvEventRejected(f"BlockStored from {worker_id}: block ids must be ints") from exc
        if fresh:  # the common case: all ids new to this worker
            before = len(blocks)
            blocks.update(zip(engine_hashes, ours))
            if len(blocks) - before == n:
                extra = w.extra
                for h in self._owners.add(ours, w.slot):
                    extra[h] = extra.get(h, 0) + 1
                return n
            for e in engine_hashes:  # an id repeated inside the event: undo, take the careful path
                blocks.pop(e, None)
        for e, h in zip(engine_hashes, ours):  # re-stored ids (replay overlap, full re-reports)
            old = blocks.get(e)
            if old == h:
                continue
            if old is not None:
                self._unref(w, [old])
            blocks[e] = h
            for dup in self._owners.add([h], w.slot):
                w.extra[dup] = w.extra.get(dup, 0) + 1
        return n

    def remove(self, worker_id: str, engine_hashes: list[int], events: int = 1) -> int:
        """`events`: how many BlockRemoved events these hashes came in (apply_batch merges runs of them)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        ours: list[int] = []
        keep = ours.append
        try:
            for h in map(w.blocks.pop, engine_hashes, repeat(None)):
                if h is not None:
                    keep(h)
        except TypeError as exc:  # an unhashable id: what was popped before it is removed all the same
            self._unref(w, ours)
            raise KvEventRejected(f"BlockRemoved from {worker_id}: block ids must be ints") from exc
        w.events += events
        self._unref(w, ours)
        return len(ours)

    def _unref(self, w: _Worker, ours: list[int]) -> None:
        extra = w.extra
        if extra:
            gone = []
            for h in ours:
                c = extra.get(h)
                if c is None:
                    gone.append(h)
                elif c == 1:
                    del extra[h]
                else:
                    extra[h] = c - 1
            ours = gone
        self._owners.remove(ours, w.slot)

    def _event_worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None or w.predicted is not None:
            self.add_worker(worker_id, approximate=False)
            w = self._workers[worker_id]
        w.events += 1
        return w

    # ---- queries and approximate mode --------------------------------------------------------

    def find_matches(self, hashes: list[int]) -> dict[str, int]:
        """worker_id -> consecutive blocks of `hashes` it holds from the start (only workers > 0)."""
        if not hashes:
            return {}
        out: dict[str, int] = {}
        by_slot = self._by_slot
        for depth, mask in self._owners.match(hashes, self._pending):
            while mask:
                low = mask & -mask
                out[by_slot[low.bit_length() - 1].worker_id] = depth
                mask ^= low
        return out

    def record_routed(self, worker_id: str, hashes: list[int], now: float | None = None, cached: int = 0) -> None:
        """A request with these block hashes was routed to `worker_id`, where its first `cached` blocks are held:
        approximate mode's predictions, or an event-fed worker's pending ones."""
        w = self._workers.get(worker_id)
        if w is None:
            if not self.auto_approximate:
                return
            self.add_worker(worker_id, approximate=True)
            w = self._workers[worker_id]
        w.routed += 1
        p = w.predicted
        if p is None:
            if w.events == 0 and w.routed == self.silent_warn_after:
                log.warning("worker %s: %d requests routed and not one KV event received; is its KV event publisher on?", worker_id, w.routed)
            if self.pending_ttl_s > 0:
                now = self.clock() if now is None else now
                if w.pending:
                    self._expire_pending(w, now)
                if cached < len(hashes):
                    new = hashes[cached:]
                    self._pending.add(new, w.slot)
                    w.pending.append((now + self.pending_ttl_s, new))
                    w.pending_size += len(new)
                    if w.pending_size > self.approx_max_blocks:
                        self._drop_pending(w, float("inf"), int(self.approx_max_blocks * self.approx_prune_ratio))
            return
        if not hashes:
            return
        now = self.clock() if now is None else now
        self._expire_worker(w, now)
        p.add(hashes, now)
        self._owners.add(hashes, w.slot)
        if p.size() > self.approx_max_blocks:
            self._owners.remove(p.prune(int(self.approx_max_blocks * self.approx_prune_ratio)), w.slot)

    def expire(self, now: float | None = None) -> None:
        """Drop predicted and pending entries older than their TTL (call every few seconds)."""
        now = self.clock() if now is None else now
        for w in self._workers.values():
            if w.predicted is not None:
                self._expire_worker(w, now)
            if w.pending:
                self._expire_pending(w, now)

    def _expire_pending(self, w: _Worker, now: float) -> None:
        """Drop the worker's pending predictions past their TTL, in batches: only once the oldest is a quarter TTL
        late, then everything expired."""
        q = w.pending
        if q and now >= q[0][0] + self.pending_ttl_s / 4:
            self._drop_pending(w, now, float("inf"))

    def _drop_pending(self, w: _Worker, expired_by: float, keep_at_most: float) -> None:
        """Drop the oldest predictions while they expire by `expired_by` or more than `keep_at_most` blocks are
        pending (the cap is approx_max_blocks, as in approximate mode). The table keeps one bit per (hash, worker),
        so a younger prediction sharing blocks with a dropped one loses them early: by then (a TTL after the older
        request was routed) the engine's events have long said whether the worker holds them. Clearing only the
        dropped keeps the cost to the blocks dropped."""
        q, table, slot = w.pending, self._pending, w.slot
        while q and (q[0][0] <= expired_by or w.pending_size > keep_at_most):
            hashes = q.popleft()[1]
            w.pending_size -= len(hashes)
            table.remove(hashes, slot)

    def _expire_worker(self, w: _Worker, now: float) -> None:
        dropped = w.predicted.expire(now)
        if dropped:
            self._owners.remove(dropped, w.slot)
