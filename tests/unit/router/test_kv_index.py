"""The prefix index, driven with literal events on both kernel implementations."""

from __future__ import annotations

import pytest

from router import KvEventRejected, KvIndex, block_hashes
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .conftest import assert_consistent

BS = 4
T = list(range(100, 132))  # 8 blocks of 4
H = block_hashes(T, BS)  # our ids of the 8 prefixes


def stored(ids, parent, first_block, n=None, **kw):
    n = len(ids) if n is None else n
    return BlockStored(list(ids), parent, T[first_block * BS:(first_block + n) * BS], BS, **kw)


def test_store_chains_from_parent_and_matches(impl):
    ix = KvIndex()
    ix.apply("a", stored([11, 12], None, 0))
    ix.apply("a", stored([13], 12, 2))  # parent = engine id 12 -> continues our chain
    ix.apply("b", stored([21], None, 0))
    assert ix.find_matches(H) == {"a": 3, "b": 1}
    assert ix.find_matches(H[:2]) == {"a": 2, "b": 1}
    assert ix.find_matches(block_hashes(T[:8], BS)) == {"a": 2, "b": 1}
    assert ix.find_matches(block_hashes([1] * 8, BS)) == {}
    assert ix.find_matches([]) == {}
    assert ix.tree_sizes() == {"a": 3, "b": 1} and len(ix) == 3
    assert_consistent(ix)


@pytest.mark.parametrize(
    "ids_a, ids_b",
    [
        ([1, 2, 3], [2**64 - 1, 7, 2**63]),  # two engines, two unrelated id schemes
        ([5, 6, 7], [5, 6, 7]),  # the same ids on two workers do not collide
    ],
)
def test_engine_ids_are_opaque_and_per_worker(impl, ids_a, ids_b):
    ix = KvIndex()
    ix.apply("a", stored(ids_a, None, 0))
    ix.apply("b", stored(ids_b, None, 0))
    assert ix.find_matches(H) == {"a": 3, "b": 3}
    ix.apply("a", BlockRemoved([ids_a[1]]))  # a's middle block: a now matches 1
    assert ix.find_matches(H) == {"a": 1, "b": 3}
    assert_consistent(ix)


def test_remove_middle_block_cuts_the_match_and_unknown_ids_are_ignored(impl):
    ix = KvIndex()
    ix.apply("a", stored([1, 2, 3, 4], None, 0))
    assert ix.apply("a", BlockRemoved([3, 999])) == 1
    assert ix.find_matches(H) == {"a": 2}
    assert ix.apply("zzz", BlockRemoved([1])) == 0  # a worker the index never saw
    assert_consistent(ix)


def test_all_blocks_cleared_and_remove_worker_touch_only_that_worker(impl):
    ix = KvIndex()
    ix.apply("a", stored([1, 2], None, 0))
    ix.apply("b", stored([1, 2, 3], None, 0))
    ix.apply("a", AllBlocksCleared())
    assert ix.find_matches(H) == {"b": 3} and ix.workers() == ["a", "b"]
    ix.apply("a", stored([1], None, 0))
    ix.remove_worker("b")
    assert ix.find_matches(H) == {"a": 1} and ix.workers() == ["a"]
    ix.apply("c", stored([9], None, 0))  # reuses b's slot
    assert ix.find_matches(H) == {"a": 1, "c": 1}
    assert_consistent(ix)


def test_duplicate_store_is_idempotent_and_salted_duplicates_are_refcounted(impl):
    ix = KvIndex()
    ix.apply("a", stored([1, 2], None, 0))
    ix.apply("a", stored([1, 2], None, 0))  # replay overlap: same ids again
    assert ix.tree_sizes() == {"a": 2}
    ix.apply("a", stored([51, 52], None, 0))  # same tokens under other ids (e.g. a cache salt)
    assert ix.tree_sizes() == {"a": 2}
    ix.apply("a", BlockRemoved([1, 2]))
    assert ix.find_matches(H) == {"a": 2}  # still held through 51, 52
    ix.apply("a", BlockRemoved([51, 52]))
    assert ix.find_matches(H) == {}
    assert_consistent(ix)


def test_restored_id_with_other_tokens_moves(impl):
    ix = KvIndex()
    ix.apply("a", stored([1], None, 0))
    ix.apply("a", BlockStored([1], None, [7, 7, 7, 7], BS))  # engine reused id 1 for other content
    assert ix.find_matches(H) == {}
    assert ix.find_matches(block_hashes([7, 7, 7, 7], BS)) == {"a": 1}
    assert_consistent(ix)


@pytest.mark.parametrize(
    "event, why",
    [
        (BlockStored([1], 424242, T[:4], BS), "parent"),  # parent never stored there
        (BlockStored([1, 2], None, T[:5], BS), "tokens"),  # 5 tokens for 2 blocks of 4
        (BlockStored([1], None, T[:8], 8), "block_size"),  # not the worker's block size
        (BlockStored([1], None, [-1, 0, 0, 0], BS), "hash"),  # not a uint32 token
        (BlockStored([1], None, [], 0), "block_size"),
        (BlockStored([[1]], None, T[:4], BS), "ints"),  # unhashable id
    ],
)
def test_rejected_events_leave_the_index_unchanged(impl, event, why):
    ix = KvIndex()
    ix.add_worker("a", block_size=BS)
    ix.apply("a", stored([5, 6], None, 0))
    before = (ix.find_matches(H), ix.tree_sizes(), len(ix))
    with pytest.raises(KvEventRejected):
        ix.apply("a", event)
    assert (ix.find_matches(H), ix.tree_sizes(), len(ix)) == before
    assert_consistent(ix)


def test_offload_tiers_are_not_indexed(impl):
    ix = KvIndex()
    ix.apply("a", stored([1, 2], None, 0, medium="CPU"))
    assert ix.find_matches(H) == {}
    ix.apply("a", stored([1, 2], None, 0, medium="GPU"))
    ix.apply("a", BlockRemoved([1], medium="CPU"))  # gone from CPU: GPU copy stays
    assert ix.find_matches(H) == {"a": 2}


def test_lora_blocks_match_only_lora_requests(impl):
    ix = KvIndex()
    ix.apply("a", stored([1, 2], None, 0, lora_name="sql"))
    assert ix.find_matches(H) == {}
    assert ix.find_matches(block_hashes(T, BS, lora_name="sql")) == {"a": 2}


def test_more_than_64_workers(impl):
    ix = KvIndex()
    for i in range(150):
        ix.apply(f"w{i}", stored([i * 10 + k for k in range(1 + i % 3)], None, 0))
    m = ix.find_matches(H)
    assert len(m) == 150 and all(m[f"w{i}"] == 1 + i % 3 for i in range(150))
    for i in range(0, 150, 2):
        ix.remove_worker(f"w{i}")
    assert sorted(ix.find_matches(H)) == sorted(f"w{i}" for i in range(1, 150, 2))
    assert_consistent(ix)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_approximate_mode_predicts_routed_blocks_with_ttl(impl, caplog):
    clock = Clock()
    ix = KvIndex(approx_ttl_s=120, clock=clock)
    with caplog.at_level("WARNING"):
        ix.record_routed("a", H[:3])  # never heard of: approximate mode, loudly
    assert "PREDICTED" in caplog.text and ix.is_approximate("a")
    assert ix.find_matches(H) == {"a": 3}
    clock.t += 100
    ix.record_routed("a", H[:5])  # touched again: lives on
    clock.t += 100
    ix.expire()
    assert ix.find_matches(H) == {"a": 5}
    clock.t += 136  # 120 s TTL + 15 s bucket after the last touch
    ix.expire()
    assert ix.find_matches(H) == {}
    assert_consistent(ix)


def test_approximate_mode_is_capped(impl):
    ix = KvIndex(approx_max_blocks=100, clock=Clock())
    for i in range(50):
        ix.record_routed("a", block_hashes([i] * 40, BS))  # 10 blocks each
    assert ix.tree_sizes()["a"] <= 100
    assert_consistent(ix)


def test_events_switch_a_predicted_worker_to_exact(impl):
    ix = KvIndex(pending_ttl_s=0)
    ix.record_routed("a", H)
    ix.apply("a", stored([1], None, 0))  # first real event: predictions dropped
    assert not ix.is_approximate("a") and ix.find_matches(H) == {"a": 1}
    ix.record_routed("a", H)  # with pending predictions off, event-fed workers are not predicted
    assert ix.find_matches(H) == {"a": 1}
    assert_consistent(ix)


def test_pending_predictions_until_events_confirm_then_expire(impl):
    """A request routed to an event-fed worker counts as cached there until its events come (pending), for
    pending_ttl_s; only the blocks past what the worker holds are predicted, and the TTL ends them in batches."""
    clock = Clock()
    ix = KvIndex(pending_ttl_s=10, clock=clock)
    ix.apply("a", stored([1, 2], None, 0))
    ix.apply("b", stored([9], None, 0))
    ix.record_routed("a", H, cached=2)  # blocks 2..7 will be stored by this request
    assert ix.find_matches(H) == {"a": 8, "b": 1}
    assert ix.pending_blocks() == 6 and len(ix) == 2 and ix.tree_sizes() == {"a": 2, "b": 1}
    assert_consistent(ix)
    clock.t = 1005.0
    ix.record_routed("b", H[:4], cached=1)
    assert ix.find_matches(H) == {"a": 8, "b": 4}
    ix.apply("a", stored([3, 4, 5], 2, 2))  # the engine confirms part of it; the rest stays pending
    assert ix.find_matches(H) == {"a": 8, "b": 4}
    clock.t = 1011.0  # a's prediction is 1 s past its TTL: not yet (batches start a quarter TTL late)
    ix.expire()
    assert ix.find_matches(H) == {"a": 8, "b": 4}
    clock.t = 1012.6
    ix.expire()  # a's goes; what its events stored stays; b's (expires at 15) is live
    assert ix.find_matches(H) == {"a": 5, "b": 4}
    assert_consistent(ix)
    clock.t = 1020.0
    ix.record_routed("c", H, cached=0)  # expiry also runs on routing, per worker
    ix.expire()
    assert ix.find_matches(H) == {"a": 5, "b": 1, "c": 8}
    assert_consistent(ix)


def test_pending_predictions_are_capped_per_worker(impl):
    ix = KvIndex(pending_ttl_s=10, approx_max_blocks=10, clock=Clock())
    ix.add_worker("a", block_size=BS)
    for i in range(6):
        ix.record_routed("a", block_hashes([i] * 12, BS))  # 3 blocks each
    assert ix._workers["a"].pending_size <= 10 and ix.pending_blocks() <= 10
    assert ix.find_matches(block_hashes([5] * 12, BS)) == {"a": 3}  # the newest stay
    assert ix.find_matches(block_hashes([0] * 12, BS)) == {}
    assert_consistent(ix)


def test_pending_predictions_drop_with_the_oldest_and_clear_with_the_worker(impl):
    clock = Clock()
    ix = KvIndex(pending_ttl_s=10, clock=clock)
    ix.add_worker("a", block_size=BS)
    ix.add_worker("b", block_size=BS)
    ix.record_routed("a", H[:6])
    clock.t = 1004.0
    ix.record_routed("a", H[:6], cached=6)  # held (pending) already: nothing new to predict
    ix.record_routed("a", H[:8], cached=6)  # only blocks 6 and 7 are new
    assert ix.find_matches(H) == {"a": 8} and ix._workers["a"].pending_size == 8
    clock.t = 1013.0
    ix.expire()  # the first prediction goes, with its six blocks: the second one's two no longer chain from the root
    assert ix.find_matches(H) == {} and ix._workers["a"].pending_size == 2
    assert_consistent(ix)
    ix.record_routed("b", H)
    ix.apply("a", AllBlocksCleared())  # a reset engine holds nothing: its predictions go with its blocks
    assert ix.find_matches(H) == {"b": 8}
    ix.remove_worker("b")
    assert ix.find_matches(H) == {} and ix.pending_blocks() == 0
    assert_consistent(ix)


def test_silent_publisher_warning(caplog):
    ix = KvIndex(silent_warn_after=3)
    ix.add_worker("a")
    with caplog.at_level("WARNING"):
        for _ in range(3):
            ix.record_routed("a", H)
    assert "not one KV event" in caplog.text


def test_a_batch_applies_runs_of_removals_as_its_events_one_by_one_would(impl):
    """apply_batch merges runs of consecutive BlockRemoved (vLLM sends one per evicted block): the index, the
    per-worker event counts and the rejections must be those of applying each event on its own."""
    import random

    rng = random.Random(5)
    for trial in range(30):
        batched, single = KvIndex(), KvIndex()
        events, live, next_id = [], [], 1
        for _ in range(rng.randrange(5, 60)):
            r = rng.random()
            if r < 0.3 or not live:
                n = rng.randrange(1, 4)
                ids = list(range(next_id, next_id + n))
                next_id += n
                parent = rng.choice(live) if live and rng.random() < 0.5 else None
                events.append(stored(ids, parent, rng.randrange(0, 8 - n)))
                live += ids
            elif r < 0.9:
                victim = rng.choice(live) if rng.random() < 0.9 else 10_000 + rng.randrange(5)  # or an unknown id
                events.append(BlockRemoved([victim], medium=rng.choice([None, "GPU", "CPU"])))
            elif r < 0.95:
                events.append(BlockRemoved([rng.choice(live), [0]]))  # an unhashable id after a good one: rejected
            else:
                events.append(AllBlocksCleared())
        rejected = batched.apply_batch("a", events)
        expected = 0
        for ev in events:
            try:
                single.apply("a", ev)
            except KvEventRejected:
                expected += 1
        assert len(rejected) == expected, trial
        assert batched._workers["a"].events == single._workers["a"].events, trial
        assert batched._workers["a"].blocks == single._workers["a"].blocks, trial
        assert batched.find_matches(H) == single.find_matches(H) and len(batched) == len(single), trial
        assert_consistent(batched)
