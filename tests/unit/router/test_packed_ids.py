"""KV events' token ids read as uint32 buffers (router._kvcore.msgpack_u32, vLLM's decode_payload(packed_ids=True)):
the same ids, the same index and the same refusals as reading them into lists."""

from __future__ import annotations

import random
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import KvEventRejected, KvIndex
from router.events import KvEventIngestor, _Source
from router.kv_events import BlockRemoved, BlockStored, KvEventDecodeError
from workers.types import WorkerInfo
from workers.sglang import kv_events as sglang_codec
from workers.vllm import kv_events as vllm_codec
from workers.vllm.kv_events import decode_payload, encode_batch

from .test_kv_fuzz import event_maps, values

kvcore = pytest.importorskip("router._kvcore")
msgpack_u32 = kvcore.msgpack_u32
U32 = st.integers(0, 2**32 - 1)


def ints_of(buf: bytes) -> list[int]:
    return list(memoryview(buf).cast("I"))


@settings(max_examples=300, deadline=None)
@given(st.lists(U32, max_size=70))
def test_every_array_of_u32_reads_back(xs):
    """fixarray and array16 headers; fixint, uint8/16/32 items (msgspec picks the smallest)."""
    assert ints_of(msgpack_u32(msgspec.msgpack.encode(xs))) == xs


def test_an_array32_reads_back():
    xs = [random.Random(3).randrange(2**32) for _ in range(70_000)]
    raw = msgspec.msgpack.encode(xs)
    assert raw[0] == 0xDD and ints_of(msgpack_u32(raw)) == xs


def test_signed_and_wide_encodings_of_u32_values_are_read():
    items = [(0xD0, ">b", 5), (0xD1, ">h", 1), (0xD2, ">i", 2**31 - 1), (0xD3, ">q", 2**32 - 1), (0xCF, ">Q", 7),
             (0xCE, ">I", 2**32 - 1), (0xCD, ">H", 0), (0xCC, ">B", 255)]
    raw = bytes([0x90 | len(items)]) + b"".join(bytes([tag]) + struct.pack(fmt, v) for tag, fmt, v in items)
    assert ints_of(msgpack_u32(raw)) == [v for _, _, v in items]


@pytest.mark.parametrize("raw", [
    msgspec.msgpack.encode([-1]), msgspec.msgpack.encode([2**32]), msgspec.msgpack.encode([2**64 - 1]),
    msgspec.msgpack.encode(["a"]), msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode([None]),
    msgspec.msgpack.encode([True]), msgspec.msgpack.encode([[1]]), msgspec.msgpack.encode({"a": 1}),
    msgspec.msgpack.encode(5), msgspec.msgpack.encode([1, 2]) + b"x", msgspec.msgpack.encode([1, 2])[:-1], b"",
    bytes([0x91, 0xD0, 0xFF]), bytes([0x91, 0xD3]) + b"\xff" * 8, bytes([0x91, 0xCF, 0, 0, 0, 1, 0, 0, 0, 0]),
    bytes([0xDD, 0xFF, 0xFF, 0xFF, 0xFF, 1]),  # an array32 claiming 4 billion items in 6 bytes
])
def test_anything_else_is_none(raw):
    assert msgpack_u32(raw) is None


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=40) | st.builds(msgspec.msgpack.encode, values))
def test_arbitrary_bytes_never_crash_and_agree_with_msgspec(raw):
    out = msgpack_u32(raw)
    try:
        expected = msgspec.msgpack.decode(raw, type=list[int])
    except msgspec.DecodeError:
        expected = None
    if expected is None or not all(0 <= v < 2**32 for v in expected):
        assert out is None
    else:
        assert out is not None and ints_of(out) == expected


CODECS = {"vllm": vllm_codec, "sglang": sglang_codec}  # both decode packed ids from their typed path


def _batches(rng: random.Random, n: int, encode=encode_batch) -> list[bytes]:
    out, stored = [], []
    for i in range(n):
        blocks = rng.randint(1, 6)
        hashes = [rng.randrange(-(2**63), 2**64) for _ in range(blocks)]
        parent = stored[-1] if stored and rng.random() < 0.5 else None
        ids = [rng.choice([rng.randrange(2**32), rng.randrange(128), rng.randrange(2**16)]) for _ in range(blocks * 4)]
        if rng.random() < 0.05:
            ids[rng.randrange(len(ids))] = rng.choice([-3, 2**32, 2**40])  # out of range: the index refuses it
        events = [BlockStored(hashes, parent, ids, 4)]
        if stored and rng.random() < 0.3:
            events.append(BlockRemoved(rng.sample(stored, k=min(3, len(stored)))))
        stored += hashes
        out.append(encode(float(i), events))
    return out


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("seed", range(20))
def test_packed_and_listed_ids_build_the_same_index(seed, codec):
    mod = CODECS[codec]
    indexes, outcomes = [], []
    for packed in (False, True):
        index, seen = KvIndex(), []
        index.add_worker("w", block_size=4)
        for payload in _batches(random.Random(seed), 40, mod.encode_batch):
            batch = mod.decode_payload(payload, packed_ids=packed)
            for ev in batch.events:
                try:
                    seen.append(index.apply("w", ev))
                except KvEventRejected as exc:
                    seen.append(str(exc))
        indexes.append(index)
        outcomes.append(seen)
    assert outcomes[0] == outcomes[1]
    assert indexes[0]._workers["w"].blocks == indexes[1]._workers["w"].blocks
    assert indexes[0].find_matches(list(indexes[0]._workers["w"].blocks.values())) == \
        indexes[1].find_matches(list(indexes[1]._workers["w"].blocks.values()))


@pytest.mark.parametrize("codec", list(CODECS))
def test_ids_are_packed_only_where_they_fit(codec):
    mod = CODECS[codec]
    ok = mod.decode_payload(mod.encode_batch(0.0, [BlockStored([1], None, [0, 5, 2**32 - 1, 70000], 4)]), packed_ids=True)
    ids = ok.events[0].token_ids
    assert isinstance(ids, memoryview) and ids.format == "I" and list(ids) == [0, 5, 2**32 - 1, 70000]
    big = mod.decode_payload(mod.encode_batch(0.0, [BlockStored([1], None, [0, 5, 2**32, 1], 4)]), packed_ids=True)
    assert big.events[0].token_ids == [0, 5, 2**32, 1]  # a list, which the index refuses as before
    listed = mod.decode_payload(mod.encode_batch(0.0, [BlockStored([1], None, [0, 5, 6, 7], 4)]))
    assert listed.events[0].token_ids == [0, 5, 6, 7]


@settings(max_examples=200, deadline=None)
@given(st.lists(event_maps | values, max_size=3))
def test_the_packed_decoder_only_raises_decode_error_and_agrees_on_refusals(events):
    payload = msgspec.msgpack.encode([1.0, events])
    for mod in CODECS.values():
        _agree_on(mod, payload)


def _agree_on(mod, payload: bytes) -> None:
    results = []
    for packed in (False, True):
        try:
            batch = mod.decode_payload(payload, packed_ids=packed)
            results.append([(type(e).__name__, list(getattr(e, "token_ids", []))) for e in batch.events])
        except KvEventDecodeError:
            results.append("refused")
    assert results[0] == results[1]


def test_the_reader_asks_vllm_and_sglang_for_packed_ids(tmp_path):
    ing = KvEventIngestor(KvIndex())

    def source(backend: str) -> _Source:
        info = WorkerInfo(worker_id=backend, model="m", backend=backend, url="http://127.0.0.1:9", block_size=4,
                          kv_events_endpoint=f"ipc://{tmp_path}/{backend}")
        return _Source(ing, info, backend)

    payload = encode_batch(0.0, [BlockStored([1], None, [1, 2, 3, 4], 4)])
    assert isinstance(source("vllm").decode(3, payload).events[0].token_ids, memoryview)
    from workers.sglang.kv_events import encode_batch as sglang_encode

    sg = source("sglang").decode(3, sglang_encode(0.0, [BlockStored([1], None, [1, 2, 3, 4], 4)]))
    assert isinstance(sg.events[0].token_ids, memoryview) and list(sg.events[0].token_ids) == [1, 2, 3, 4]
