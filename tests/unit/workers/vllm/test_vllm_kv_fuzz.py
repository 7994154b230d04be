"""Fuzzing `decode_payload`: whatever the bytes, only KvEventDecodeError may escape."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from router.kv_events import KvEventBatch, KvEventDecodeError
from workers.vllm.kv_events import decode_payload

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "block_hashes", "block_size"]),
)
_values = st.recursive(
    _scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=6), st.dictionaries(st.one_of(st.text(max_size=12), _scalars.filter(lambda v: isinstance(v, (str, int, bytes)))), kids, max_size=6)),
    max_leaves=30,
)
_event_keys = st.sampled_from(
    ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_name", "lora_id", "extra_keys"]
)
_events = st.one_of(
    st.dictionaries(_event_keys, _values, max_size=8),
    st.lists(_values, max_size=8).map(lambda xs: [xs[0] if xs and isinstance(xs[0], str) else "BlockStored", *xs[1:]]),
    _values,
)
_batches = st.tuples(_values, st.lists(_events, max_size=4), _values).map(list)


def _check(payload: bytes) -> None:
    try:
        out = decode_payload(payload)
    except KvEventDecodeError:
        return
    assert isinstance(out, KvEventBatch)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes(payload):
    _check(payload)


@settings(max_examples=400, deadline=None)
@given(_batches)
def test_random_batch_structures(batch):
    _check(msgspec.msgpack.encode(batch))


@settings(max_examples=300, deadline=None)
@given(_values)
def test_random_msgpack_values(value):
    _check(msgspec.msgpack.encode(value))


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=120), st.integers(min_value=0, max_value=119))
def test_truncated_and_corrupted_valid_payload(noise, cut):
    good = msgspec.msgpack.encode(
        [1.5, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1] * 64, "block_size": 32}], 0]
    )
    _check(good[: cut % len(good)])
    _check(good[: cut % len(good)] + noise)


def test_deeply_nested_payload_is_a_decode_error():
    """msgspec raises RecursionError on deep nesting; it must surface as KvEventDecodeError."""
    for payload in (b"\x91" * 200_000, b"\x92\x01" + b"\x91" * 200_000):
        _check(payload)
