"""Decoding vLLM's KV-event wire format: the golden 0.32 captures, the legacy array form, replay, bytes hashes."""

from __future__ import annotations

import msgspec
import pytest

from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventDecodeError
from workers.vllm.kv_events import (
    END_SEQ,
    decode_payload,
    decode_pub_frames,
    decode_replay_frames,
    encode_batch,
    pack_seq,
    unpack_seq,
)


def _step(kv_golden, name):
    step = next(s for s in kv_golden["steps"] if s["name"] == name)
    return [decode_pub_frames([bytes.fromhex(f) for f in m]) for m in step["messages"]]


def test_every_golden_message_decodes_in_sequence(pub_messages):
    batches = [decode_pub_frames(m) for m in pub_messages]
    assert [b.seq for b in batches] == list(range(len(batches)))
    assert all(m[0] == b"kv-events" for m in pub_messages)
    assert all(b.dp_rank == 0 and b.ts > 1e9 for b in batches)


def test_first_prompt_stores_two_full_blocks(kv_golden):
    [batch] = _step(kv_golden, "first")
    [ev] = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_size == 32 and ev.parent_block_hash is None and ev.medium == "GPU"
    assert len(ev.block_hashes) == 2 and ev.token_ids == kv_golden["steps"][0]["prompt_token_ids"][:64]


def test_prefix_reuse_chains_to_the_cached_prefix(kv_golden):
    [first] = _step(kv_golden, "first")
    [reuse] = _step(kv_golden, "prefix_reuse")
    [ev] = reuse.events
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash == first.events[0].block_hashes[-1]
    assert len(ev.block_hashes) == 1 and len(ev.token_ids) == 32


def test_eviction_removes_the_least_recently_used_blocks(kv_golden):
    stored = {h for s in ("first", "prefix_reuse") for b in _step(kv_golden, s) for e in b.events for h in e.block_hashes}
    [batch] = _step(kv_golden, "evict_2")
    removed = [h for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert stored <= set(removed)
    assert isinstance(batch.events[-1], BlockStored)


def test_reset_emits_all_blocks_cleared(kv_golden):
    [batch] = _step(kv_golden, "reset_then_first")
    assert isinstance(batch.events[0], AllBlocksCleared)
    [first] = _step(kv_golden, "first")
    assert batch.events[1].block_hashes == first.events[0].block_hashes  # same content, same hashes


def test_replay_returns_every_batch_then_end(kv_golden, pub_messages):
    replies = [[bytes.fromhex(f) for f in r] for r in kv_golden["replay_from_0"]]
    decoded = [decode_replay_frames(r) for r in replies]
    assert decoded[-1] is None and replies[-1][2] == pack_seq(END_SEQ, signed=True)
    live = [decode_pub_frames(m) for m in pub_messages]
    assert [b.seq for b in decoded[:-1]] == [b.seq for b in live]
    assert [b.events for b in decoded[:-1]] == [b.events for b in live]
    assert all(r[0] == b"" and r[1] == b"kv-events" for r in replies[:-1])


def test_legacy_replay_form_without_topic(pub_messages):
    topic, seq, payload = pub_messages[0]
    assert decode_replay_frames([b"", seq, payload]).events == decode_pub_frames(pub_messages[0]).events


def test_legacy_array_batch(legacy_golden):
    batch = decode_pub_frames([bytes.fromhex(f) for f in legacy_golden["frames"]])
    stored, removed, cleared = batch.events
    exp = legacy_golden["expected"]
    assert batch.seq == 7 and batch.dp_rank is None
    assert stored == BlockStored(
        exp["stored"]["block_hashes"], exp["stored"]["parent_block_hash"], exp["stored"]["token_ids"], 32, None, "GPU"
    )
    assert removed == BlockRemoved(exp["removed"]["block_hashes"], "GPU")
    assert cleared == AllBlocksCleared()


def test_bytes_hashes_map_to_the_published_ints(pub_messages):
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes raw digests; the low 64 bits are the int form."""
    raw = msgspec.msgpack.decode(pub_messages[0][2])
    ints = raw[1][0]["block_hashes"]
    raw[1][0]["block_hashes"] = [b"\x00" * 24 + h.to_bytes(8, "big") for h in ints]
    raw[1][0]["parent_block_hash"] = b"\xaa" * 24 + (5).to_bytes(8, "big")
    ev = decode_payload(msgspec.msgpack.encode(raw)).events[0]
    assert ev.block_hashes == ints and ev.parent_block_hash == 5


def test_encode_batch_roundtrips_and_matches_vllm_layout(pub_messages):
    live = decode_pub_frames(pub_messages[0])
    payload = encode_batch(live.ts, live.events, dp_rank=0)
    assert payload == pub_messages[0][2]  # byte-identical to what vLLM 0.32 sent


def test_unknown_event_kinds_and_fields_are_ignored():
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "FutureEvent", "x": 1}, {"type": "BlockRemoved", "block_hashes": [1], "medium": None, "new": 2}]]
    )
    assert decode_payload(payload).events == [BlockRemoved([1], None)]


@pytest.mark.parametrize(
    "frames",
    [
        [b"t", pack_seq(0)],
        [b"t", b"\x00" * 7, msgspec.msgpack.encode([1.0, []])],
        [b"t", pack_seq(0), b"\xc1"],
        [b"t", pack_seq(0), msgspec.msgpack.encode({"ts": 1})],
        [b"t", pack_seq(0), msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0]]])],
        [b"t", pack_seq(0), msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"], "block_size": 1}]])],
        [b"t", pack_seq(0), msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [True]}]])],
        [b"t", pack_seq(0), msgspec.msgpack.encode([1.0, [42]])],
        [b"t", pack_seq(0), msgspec.msgpack.encode([1.0, [], "rank"])],
    ],
    ids=["two-frames", "short-seq", "not-msgpack", "batch-map", "zero-block-size", "str-hash", "bool-hash", "bare-int", "str-rank"],
)
def test_malformed_frames_raise_decode_error(frames):
    with pytest.raises(KvEventDecodeError):
        decode_pub_frames(frames)


def test_unpack_seq_end_marker():
    assert unpack_seq(pack_seq(END_SEQ, signed=True)) == END_SEQ
    assert unpack_seq(pack_seq(2**63)) == 2**63
