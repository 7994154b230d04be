"""Sequence handling per worker: order, gaps -> replay, partial replays -> purge, restarts. Table-driven."""

from __future__ import annotations

import pytest

from router import KvIndex, block_hashes
from router.event_stream import EventStream, Replay
from router.kv_events import BlockRemoved, BlockStored, KvEventBatch

BS = 2
TOKENS = list(range(10, 40))  # 15 blocks
H = block_hashes(TOKENS, BS)


def b(seq: int) -> KvEventBatch:
    """Batch `seq` stores block `seq` of TOKENS, chained to block seq - 1 (engine ids = 100 + block)."""
    return KvEventBatch(seq, 0.0, [BlockStored([100 + seq], None if seq == 0 else 99 + seq, TOKENS[seq * BS:(seq + 1) * BS], BS)])


def run(script, replayable=True):
    """script: ("live", seq) | ("bad", seq) (undecodable) ; replays answered from `answers` in order."""
    ix = KvIndex()
    s = EventStream("w", ix, replayable)
    asked = []
    for op in script:
        kind, seq = op[0], op[1]
        replay = s.on_live(seq, None if kind == "bad" else b(seq))
        if replay is not None:
            asked.append((replay.start, replay.upto))
            answer = op[2] if len(op) > 2 else None
            batches = None if answer is None else [(q, b(q)) for q in answer]
            s.on_replay(replay, batches, b(seq))
    return ix.find_matches(H).get("w", 0), asked, s.stats


@pytest.mark.parametrize(
    "script, replayable, depth, asked, purges",
    [
        ([("live", q) for q in range(5)], True, 5, [], 0),  # in order
        ([("live", 0), ("live", 1), ("live", 3, [2, 3, 4]), ("live", 4), ("live", 5)], True, 6, [(2, 3)], 0),  # gap filled
        ([("live", 3, [0, 1, 2, 3]), ("live", 4)], True, 5, [(0, 3)], 0),  # late join: rebuilt from the buffer
        ([("live", 0), ("live", 2, [1, 2, 3]), ("live", 3), ("live", 4)], True, 5, [(1, 2)], 0),  # replay overlaps live
        ([("live", 0), ("live", 1), ("live", 3, None), ("live", 4)], True, 0, [(2, 3)], 1),  # replay failed: purge
        ([("live", 0), ("live", 1), ("live", 4, [3, 4])], True, 0, [(2, 4)], 1),  # buffer lost 2: purge
        ([("live", 0), ("live", 1), ("live", 3), ("live", 4)], False, 0, [], 1),  # nothing can replay: purge
        ([("live", 0), ("bad", 1), ("live", 2)], True, 1, [], 0),  # undecodable 1 counts, 2's parent unknown
    ],
)
def test_sequences(script, replayable, depth, asked, purges):
    got_depth, got_asked, stats = run(script, replayable)
    assert (got_depth, got_asked, stats.purges) == (depth, asked, purges)


def test_restart_purges_and_starts_over():
    depth, asked, stats = run([("live", 0), ("live", 1), ("live", 2), ("live", 0), ("live", 1)])
    assert (depth, asked, stats.restarts, stats.purges) == (2, [], 1, 1)


def test_restart_seen_late_replays_from_zero():
    depth, asked, stats = run([("live", 0), ("live", 1), ("live", 2), ("live", 1, [0, 1])])
    assert (depth, asked, stats.restarts) == (2, [(0, 1)], 1)


def test_after_a_purge_new_roots_index_again():
    ix = KvIndex()
    s = EventStream("w", ix, replayable=False)
    for seq in (0, 1, 5):
        s.on_live(seq, b(seq))
    assert ix.find_matches(H) == {}
    s.on_live(6, b(0))  # the engine stores the prefix again from the root
    assert ix.find_matches(H) == {"w": 1}


def test_bootstrap_then_live():
    ix = KvIndex()
    s = EventStream("w", ix, replayable=True)
    s.on_bootstrap([(q, b(q)) for q in range(4)])
    assert s.on_live(2, b(2)) is None and s.on_live(4, b(4)) is None  # a duplicate, then the next one
    assert ix.find_matches(H) == {"w": 5} and s.stats.restarts == 0
    assert s.on_live(6, b(6)) == Replay(5, 6)


def test_replay_type():
    assert Replay(2, 5) == Replay(start=2, upto=5)


def test_stats_count_stored_and_removed_blocks():
    ix = KvIndex()
    s = EventStream("w", ix, True)
    s.on_live(0, KvEventBatch(0, 0.0, [BlockStored([100, 101, 102], None, TOKENS[:3 * BS], BS)]))
    s.on_live(1, KvEventBatch(1, 0.0, [BlockRemoved([102]), BlockRemoved([101, 100])]))
    assert (s.stats.blocks_stored, s.stats.blocks_removed) == (3, 3)
    assert ix.find_matches(H).get("w", 0) == 0
