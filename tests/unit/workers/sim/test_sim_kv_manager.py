"""KvBlockManager: vLLM's hashing, prefix hits, refcounts, LRU eviction order and KV events."""

from __future__ import annotations

import pytest

from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from workers.sim.hashing import BlockHasher, sha256_pickle, to_external
from workers.sim.free_queue import FreeBlockQueue
from workers.sim.kv_manager import KvBlockManager

BS = 4


def hashes(tokens: list[int], bs: int = BS) -> list[bytes]:
    return BlockHasher(bs).hash_all(tokens)


def alloc(kv: KvBlockManager, rid: str, tokens: list[int], computed: int = 0, hit: list[int] | None = None) -> bool:
    """Allocate a whole prompt in one step, like a first prefill chunk."""
    return kv.allocate_slots(rid, tokens, hashes(tokens), computed, len(tokens) - computed, hit or [])


@pytest.mark.parametrize(
    "tokens,block_size,expected",
    [
        # captured from a live vLLM 0.32 server (tests/fixtures/vllm/capture.py): tokens 1..64, block size 32
        (list(range(1, 65)), 32, [11290800355336220572, 11189021207153552290]),
        (list(range(1, 70)), 32, [11290800355336220572, 11189021207153552290]),  # partial block not hashed
        (list(range(1, 32)), 32, []),
    ],
)
def test_block_hashes_equal_vllm(tokens, block_size, expected):
    assert [to_external(h) for h in BlockHasher(block_size).hash_all(tokens)] == expected


def test_none_hash_is_sha256_of_the_seed_and_seed_changes_hashes():
    assert BlockHasher(4).none_hash == sha256_pickle("vllm-none-hash")
    assert BlockHasher(4, "123").hash_all([1, 2, 3, 4]) != BlockHasher(4).hash_all([1, 2, 3, 4])


def test_extend_is_incremental():
    h = BlockHasher(4)
    acc = h.extend([], [1, 2, 3, 4, 5])
    assert len(acc) == 1
    assert h.extend(acc, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == h.hash_all([1, 2, 3, 4, 5, 6, 7, 8])


def test_stored_event_covers_new_full_blocks_with_parent_chain():
    kv = KvBlockManager(10, BS)
    toks = list(range(10))  # 2 full blocks + 2 tokens
    assert alloc(kv, "a", toks)
    (ev,) = kv.take_events()
    hs = hashes(toks)
    assert ev == BlockStored([to_external(h) for h in hs], None, toks[:8], BS, medium="GPU")
    # decode fills the third block: one more event, parented on block 2
    toks += [10, 11]
    assert kv.allocate_slots("a", toks, hashes(toks), 10, 1) and kv.allocate_slots("a", toks, hashes(toks), 11, 1)
    (ev2,) = kv.take_events()
    assert ev2.block_hashes == [to_external(hashes(toks)[2])] and ev2.parent_block_hash == to_external(hs[1])
    assert ev2.token_ids == [8, 9, 10, 11]


def test_prefix_hit_reuses_blocks_refcounts_and_emits_nothing():
    kv = KvBlockManager(10, BS)
    a = list(range(12))
    assert alloc(kv, "a", a)
    kv.take_events()
    b = a[:8] + [100, 101, 102, 103, 104]
    hit, n = kv.get_computed_blocks(hashes(b), len(b))
    assert hit == kv.req_blocks["a"][:2] and n == 8
    assert alloc(kv, "b", b, computed=n, hit=hit)
    assert [kv.ref_cnt[x] for x in hit] == [2, 2]
    (ev,) = kv.take_events()  # only B's own new full block
    assert ev.parent_block_hash == to_external(hashes(a)[1]) and ev.token_ids == [100, 101, 102, 103]


@pytest.mark.parametrize(
    "n_tokens,expected_hit",
    [(8, 4), (9, 8), (12, 8), (13, 12)],  # the last token is always recomputed
)
def test_hit_is_capped_below_the_last_token(n_tokens, expected_hit):
    kv = KvBlockManager(10, BS)
    toks = list(range(n_tokens))
    assert alloc(kv, "a", list(range(16)))
    kv.free("a")
    assert kv.get_computed_blocks(hashes(toks), len(toks))[1] == expected_hit


def test_free_order_tail_first_and_unhashed_blocks_reused_first():
    kv = KvBlockManager(8, BS)  # 7 usable blocks: 1..7
    assert alloc(kv, "a", list(range(10)))  # blocks 1,2 hashed, 3 partial (unhashed)
    a_blocks = list(kv.req_blocks["a"])
    kv.free("a")
    q = kv.free_queue()
    # unhashed partial block first (reused first), then never-used blocks, then hashed tail-first
    assert q[0] == a_blocks[2]
    assert q[-2:] == [a_blocks[1], a_blocks[0]]
    assert kv.usage == 0.0


def test_lru_eviction_order_and_removed_events():
    kv = KvBlockManager(5, BS)  # 4 usable blocks
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [11, 12, 13, 14, 15, 16, 17, 18]
    assert alloc(kv, "a", a) and alloc(kv, "b", b)
    kv.free("a")
    kv.free("b")
    kv.take_events()
    ha, hb = hashes(a), hashes(b)
    # a new 2-block request evicts A's blocks (freed earlier), tail block first
    c = [21, 22, 23, 24, 25, 26, 27]
    assert alloc(kv, "c", c)
    evs = kv.take_events()
    removed = [e.block_hashes[0] for e in evs if isinstance(e, BlockRemoved)]
    assert removed == [to_external(ha[1]), to_external(ha[0])]
    assert kv.get_computed_blocks(hb, 9)[1] == 8 and kv.get_computed_blocks(ha, 9)[1] == 0


def test_touching_a_cached_block_protects_it_from_eviction():
    kv = KvBlockManager(5, BS)
    a, b = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    assert alloc(kv, "a", a) and alloc(kv, "b", b)
    kv.free("a")
    kv.free("b")
    hit, n = kv.get_computed_blocks(hashes(a), len(a))  # reuse A (older) -> B's blocks become the LRU ones
    assert alloc(kv, "a2", a, computed=n, hit=hit)
    kv.take_events()
    assert alloc(kv, "c", [30, 31, 32, 33, 34, 35, 36])
    removed = [e.block_hashes[0] for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert to_external(hashes(a)[0]) not in removed and to_external(hashes(b)[0]) in removed


def test_allocation_fails_without_side_effects_when_blocks_run_out():
    kv = KvBlockManager(4, BS)  # 3 usable
    assert not alloc(kv, "a", list(range(13)))  # needs 4 blocks
    assert kv.num_free_blocks == 3 and "a" not in kv.req_blocks and kv.take_events() == []


def test_duplicate_blocks_are_both_cached_like_vllm():
    kv = KvBlockManager(6, BS)
    toks = [1, 2, 3, 4, 5]
    assert alloc(kv, "a", toks) and alloc(kv, "b", toks)  # computed concurrently, no hit
    evs = kv.take_events()
    assert len(evs) == 2 and evs[0].block_hashes == evs[1].block_hashes


def test_usage_and_reset_prefix_cache():
    kv = KvBlockManager(5, BS)
    assert alloc(kv, "a", list(range(8)))
    assert kv.usage == pytest.approx(0.5)
    assert not kv.reset_prefix_cache()  # blocks in use
    kv.free("a")
    kv.take_events()
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.get_computed_blocks(hashes(list(range(8))), 9) == ([], 0)


def test_no_caching_means_no_hits_and_no_events():
    kv = KvBlockManager(6, BS, enable_caching=False)
    assert alloc(kv, "a", list(range(9)))
    kv.free("a")
    assert kv.take_events() == [] and kv.get_computed_blocks(hashes(list(range(9))), 9) == ([], 0)


def test_free_block_queue_operations():
    from workers.sim.free_queue import FreeBlockQueue

    q = FreeBlockQueue(6, [1, 2, 3])
    q.appendleft(4)
    q.append(5)
    q.remove(2)
    assert list(q) == [4, 1, 3, 5] and len(q) == 4 and 2 not in q and 3 in q
    assert [q.popleft(), q.popleft()] == [4, 1]
    q.append(2)
    assert list(q) == [3, 5, 2]
    for _ in range(3):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


@pytest.mark.parametrize("coalesce", [False, True])
def test_evictions_publish_one_event_per_block_unless_coalesced(coalesce):
    kv = KvBlockManager(5, BS, coalesce_removals=coalesce)  # 4 usable blocks
    assert alloc(kv, "a", list(range(4 * BS)))
    kv.free("a")  # all four cached, free
    kv.take_events()
    assert alloc(kv, "b", [99] * (3 * BS))  # takes three of them: three evictions
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved)]
    ids = [h for e in removed for h in e.block_hashes]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert len(removed) == (1 if coalesce else 3)
    free_list = FreeBlockQueue(10, [3, 1, 2])
    assert list(free_list) == [3, 1, 2] and len(free_list) == 3 and 3 in free_list and 4 not in free_list
