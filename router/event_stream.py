"""One worker's KV-event sequence: ordering, gaps, replay and restarts. Pure and synchronous.

The I/O loop (router/events.py) first replays the engine's whole buffer into `on_bootstrap`
(so a new or restarted frontend knows the worker's cache at once), then feeds every batch it
receives to `on_live(seq, batch)`; batch is None when the payload could not be decoded (its
sequence number still counts). Rules:

    first batch, seq 0                 -> apply
    first batch, seq > 0               -> Replay(0, seq): rebuild from the engine's buffer
    seq == last + 1                    -> apply
    seq <= last                        -> already applied (it came by replay): skip
    seq >  last + 1  (a gap)           -> Replay(last + 1, seq)
    seq <= the previous live seq       -> the publisher restarted: purge the worker, start over
    no replay endpoint                 -> a gap purges the worker instead (nothing can fill it)

After a Replay the loop calls `on_replay(replay, batches, pending)` with the replayed
(seq, batch) pairs in order (None if the replay failed or timed out) and the live batch that
triggered it. If the replay starts exactly at `replay.start` the gap is filled; otherwise what
was missed is unknown, so the worker's entries are purged and indexing continues from the first
batch available. Either way no second replay is asked for the same gap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from router.errors import KvEventRejected
from router.kv_index import KvIndex
from router.kv_events import BlockRemoved, BlockStored, KvEventBatch

__all__ = ["EventStream", "Replay", "StreamStats"]

log = logging.getLogger("kvyard.router.events")


@dataclass(frozen=True, slots=True)
class Replay:
    start: int  # first missing sequence number
    upto: int  # the live batch that revealed the gap


@dataclass(slots=True)
class StreamStats:
    batches: int = 0
    events: int = 0
    rejected: int = 0
    undecodable: int = 0
    replays: int = 0
    purges: int = 0
    restarts: int = 0
    blocks_stored: int = 0  # blocks named by applied BlockStored events (GPU medium or not)
    blocks_removed: int = 0  # ... and by BlockRemoved: the engine's evictions


class EventStream:
    def __init__(self, worker_id: str, index: KvIndex, replayable: bool) -> None:
        self.worker_id = worker_id
        self.index = index
        self.replayable = replayable
        self.last: int | None = None  # highest sequence applied (or skipped as undecodable)
        self.last_live: int | None = None
        self.stats = StreamStats()
        self.last_rejection: KvEventRejected | None = None

    def on_live(self, seq: int, batch: KvEventBatch | None) -> Replay | None:
        if self.last_live is not None and seq <= self.last_live:
            log.warning("worker %s: KV event sequence went back from %d to %d; engine restarted, purging its entries",
                        self.worker_id, self.last_live, seq)
            self.stats.restarts += 1
            self._purge()
            self.last = None
        self.last_live = seq
        if self.last is None:
            if seq == 0 or not self.replayable:
                self._apply(seq, batch)
                return None
            return self._replay(0, seq)
        if seq <= self.last:
            return None
        if seq == self.last + 1:
            self._apply(seq, batch)
            return None
        if not self.replayable:
            log.warning("worker %s: KV events %d..%d lost and the engine cannot replay them; purging its entries",
                        self.worker_id, self.last + 1, seq - 1)
            self._purge()
            self._apply(seq, batch)
            return None
        return self._replay(self.last + 1, seq)

    def on_bootstrap(self, batches: list[tuple[int, KvEventBatch | None]]) -> None:
        """The engine's buffer, replayed from 0 before any live batch: a (re)started frontend
        rebuilds the worker's entries at once instead of waiting for the engine's next event."""
        if self.last is None and batches:
            self._apply_run(batches)

    def on_replay(self, replay: Replay, batches: list[tuple[int, KvEventBatch | None]] | None, pending: KvEventBatch | None) -> None:
        batches = batches or []
        if not batches or batches[0][0] != replay.start:
            got = "nothing" if not batches else f"from {batches[0][0]}"
            if self.last is not None or replay.start > 0:
                log.warning("worker %s: replay from %d returned %s; purging its entries and continuing",
                            self.worker_id, replay.start, got)
                self._purge()
            self.last = None
        self._apply_run(batches)
        if self.last is None or replay.upto > self.last:
            if self.last is not None and replay.upto != self.last + 1:
                self._purge()
            self._apply(replay.upto, pending)

    def _apply_run(self, batches: list[tuple[int, KvEventBatch | None]]) -> None:
        for seq, batch in batches:
            if self.last is None or seq == self.last + 1:
                self._apply(seq, batch)
            elif seq > self.last + 1:  # a hole inside the replay itself
                self._purge()
                self._apply(seq, batch)

    def _replay(self, start: int, upto: int) -> Replay:
        self.stats.replays += 1
        return Replay(start, upto)

    def _purge(self) -> None:
        self.stats.purges += 1
        self.index.clear_worker(self.worker_id)

    def _apply(self, seq: int, batch: KvEventBatch | None) -> None:
        self.last = seq
        self.stats.batches += 1
        if batch is None:
            self.stats.undecodable += 1
            return
        events = len(batch.events)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.stats.blocks_stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.stats.blocks_removed += len(ev.block_hashes)
                events += ev.events - 1  # a codec's merged run counts as the events it stands for
        self.stats.events += events
        rejected = self.index.apply_batch(self.worker_id, batch.events)
        if rejected:
            self.stats.rejected += len(rejected)
            self.last_rejection = rejected[-1]
