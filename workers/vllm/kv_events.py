"""vLLM's KV-cache event wire format (ZMQ + msgpack), encode and decode.

Wire (vLLM 0.32, `vllm/distributed/kv_events.py`):
  PUB message  = [topic, seq (8-byte big-endian unsigned), payload]
  payload      = msgpack EventBatch, positional: [ts: float, events: list, data_parallel_rank: int|None]
  event (>=0.24) = tagged map {"type": "BlockStored", "block_hashes": [...], ...}, omit_defaults
  event (<=0.23) = tagged array ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, ...]
  replay       = ROUTER socket; request [b"", start_seq (8 bytes BE)] from a DEALER;
                 reply [b"", topic, seq, payload] per buffered batch, then [b"", b"", END_SEQ=-1 (signed), b""];
                 vLLM <= 0.24 replies [seq, payload] without the topic frame.

`encode_batch` writes exactly what vLLM 0.32 writes (the sim engine uses it); `decode_payload`
accepts both event encodings, unknown fields and raw-bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
`extra_keys` (one entry per block, untagged: the bare LoRA name, (mm identifier, offset) pairs, a cache salt)
are decoded to `BlockStored.mm_keys` (the pairs; the LoRA name is `lora_name`, salts are not routed on) and
encoded back from `lora_name` + `mm_keys` as vLLM writes them.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any

import msgspec

from router.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvEventDecodeError,
                               removal_runs, token_ids_of)

__all__ = [
    "END_SEQ",
    "encode_batch",
    "decode_payload",
    "decode_pub_frames",
    "decode_replay_frames",
    "decode_mm_keys",
    "event_extra_keys",
    "pack_seq",
    "unpack_seq",
]

END_SEQ = -1
_U64 = (1 << 64) - 1


class _BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    # Field order is vLLM 0.32's; fields without a default are always present, even as nil.
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True, gc=False):
    pass


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def pack_seq(seq: int, signed: bool = False) -> bytes:
    return struct.pack(">q" if signed else ">Q", seq)


def unpack_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise KvEventDecodeError(f"sequence frame must be 8 bytes, got {len(raw)}")
    return struct.unpack(">q", raw)[0] if raw == b"\xff" * 8 else struct.unpack(">Q", raw)[0]


def encode_batch(ts: float, events: list[KvEvent], dp_rank: int | None = 0) -> bytes:
    """Encode engine-neutral events exactly as vLLM 0.32 publishes them (map-tagged events)."""
    wire: list[_BlockStored | _BlockRemoved | _AllBlocksCleared] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            n = len(ev.block_hashes)
            wire.append(
                _BlockStored(
                    block_hashes=ev.block_hashes,
                    parent_block_hash=ev.parent_block_hash,
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    lora_id=None,
                    medium=ev.medium or "GPU",
                    lora_name=ev.lora_name,
                    extra_keys=event_extra_keys(n, ev.lora_name, ev.mm_keys),
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        elif isinstance(ev, BlockRemoved):
            wire.append(_BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium or "GPU", group_idx=0))
        else:
            wire.append(_AllBlocksCleared())
    return _encoder.encode(_EventBatch(ts=ts, events=wire, data_parallel_rank=dp_rank))


def event_extra_keys(n: int, lora_name: str | None, mm_keys: list | None) -> list[Any]:
    """vLLM's untagged per-block extra keys of a BlockStored: the LoRA name, then each (identifier, offset) pair."""
    out: list[Any] = []
    for i in range(n):
        keys = ([lora_name] if lora_name else []) + [list(k) for k in ((mm_keys[i] if mm_keys and i < len(mm_keys) else None) or ())]
        out.append(keys or None)
    return out


def decode_mm_keys(extra: Any, n: int) -> list[tuple[tuple[str, int], ...] | None] | None:
    """The (identifier, offset) pairs of each block's extra keys; None when no block has one. Other keys (the LoRA
    name, a cache salt, prompt-embeds digests) are skipped; a malformed list is refused."""
    if extra is None:
        return None
    if not isinstance(extra, list) or len(extra) != n:
        raise KvEventDecodeError(f"extra_keys must be a list of {n} entries (one per block)")
    out: list[tuple[tuple[str, int], ...] | None] = []
    found = False
    for keys in extra:
        if keys is None:
            out.append(None)
            continue
        if not isinstance(keys, (list, tuple)):
            raise KvEventDecodeError("each extra_keys entry must be a list or nil")
        pairs = tuple((k[0], k[1]) for k in keys if isinstance(k, (list, tuple)) and len(k) == 2 and isinstance(k[0], str)
                      and isinstance(k[1], int) and not isinstance(k[1], bool))
        found = found or bool(pairs)
        out.append(pairs or None)
    return out if found else None


def _hash(value: Any) -> int:
    if isinstance(value, bool):
        raise KvEventDecodeError("block hash must be int or bytes, got bool")
    if isinstance(value, int):
        return value & _U64
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value, "big") & _U64
    raise KvEventDecodeError(f"block hash must be int or bytes, got {type(value).__name__}")


def _hash_list(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise KvEventDecodeError("block_hashes must be a list")
    return [_hash(v) for v in value]


def _int_list(value: Any, what: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise KvEventDecodeError(f"{what} must be a list of ints")
    return value


_STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_ORDER = ("block_hashes", "medium")


def _as_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """Both encodings -> (tag, fields)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KvEventDecodeError("event map has no string 'type'")
        return tag, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, rest = raw[0], raw[1:]
        order = _STORED_ORDER if tag == "BlockStored" else _REMOVED_ORDER if tag == "BlockRemoved" else ()
        return tag, dict(zip(order, rest))
    raise KvEventDecodeError("event is neither a tagged map nor a tagged array")


def _decode_event(raw: Any) -> KvEvent | None:
    tag, f = _as_fields(raw)
    if tag == "BlockStored":
        bs = f.get("block_size")
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0:
            raise KvEventDecodeError("BlockStored.block_size must be a positive int")
        parent = f.get("parent_block_hash")
        lora = f.get("lora_name")
        medium = f.get("medium")
        hashes = _hash_list(f.get("block_hashes"))
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=_int_list(f.get("token_ids"), "token_ids"),
            block_size=bs,
            lora_name=lora if isinstance(lora, str) else None,
            medium=medium if isinstance(medium, str) else None,
            mm_keys=decode_mm_keys(f.get("extra_keys"), len(hashes)),
        )
    if tag == "BlockRemoved":
        medium = f.get("medium")
        return BlockRemoved(block_hashes=_hash_list(f.get("block_hashes")), medium=medium if isinstance(medium, str) else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event kind we do not index; ignored like unknown fields


# Typed fast path: vLLM >= 0.24 map-tagged events with int hashes, validated by msgspec in C
# (about 3x faster than the generic path on real batches). Anything else — legacy arrays, bytes
# hashes, an event kind we do not know — falls back to the generic path below, which accepts it.
_PositiveInt = Annotated[int, msgspec.Meta(gt=0)]


class _RStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[int]
    block_size: _PositiveInt
    parent_block_hash: int | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # kept as msgpack: read by token_ids_of (an empty array by default)
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None


class _RRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int]
    medium: str | None = None


class _RCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _RBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_RStored | _RRemoved | _RCleared]
    data_parallel_rank: int | None = None


_typed_decoder = msgspec.msgpack.Decoder(_RBatch)


def _u64(hashes: list[int]) -> list[int]:
    # min/max run in C: a stored batch of a long prompt carries ~1,000 hashes (a generator here was ~6% of the loop)
    return hashes if not hashes or (min(hashes) >= 0 and max(hashes) <= _U64) else [h & _U64 for h in hashes]


def _from_typed(batch: _RBatch, seq: int, packed: bool) -> KvEventBatch:
    out: list[KvEvent] = []
    for ev in removal_runs(batch.events, _RRemoved, _u64):
        if type(ev) is BlockRemoved:
            out.append(ev)
        elif type(ev) is _RStored:
            parent = ev.parent_block_hash
            mm = decode_mm_keys(ev.extra_keys, len(ev.block_hashes)) if ev.extra_keys and any(ev.extra_keys) else None
            out.append(BlockStored(_u64(ev.block_hashes), None if parent is None else parent & _U64,
                                   token_ids_of(ev.token_ids, packed), ev.block_size, ev.lora_name, ev.medium, mm))
        else:
            out.append(AllBlocksCleared())
    return KvEventBatch(seq=seq, ts=batch.ts, events=out, dp_rank=batch.data_parallel_rank)


def decode_payload(payload: bytes, seq: int = 0, packed_ids: bool = False) -> KvEventBatch:
    """Decode one EventBatch payload. Raises KvEventDecodeError on anything malformed.

    `packed_ids`: a BlockStored's token ids as a memoryview of native uint32 where they fit (the KV-event reader,
    router/events.py: no int object per token); otherwise, and always on the generic path, a list of ints."""
    try:
        return _from_typed(_typed_decoder.decode(payload), seq, packed_ids)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        pass  # not the common modern shape: the generic path decides (and explains any error)
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:  # deep nesting -> RecursionError
        raise KvEventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2:
        raise KvEventDecodeError("EventBatch must be an array [ts, events, dp_rank?]")
    ts, events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) > 2 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise KvEventDecodeError("EventBatch ts must be a number and events a list")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)):
        raise KvEventDecodeError("EventBatch data_parallel_rank must be an int or nil")
    decoded = [e for e in (_decode_event(r) for r in events) if e is not None]
    return KvEventBatch(seq=seq, ts=float(ts), events=decoded, dp_rank=dp_rank)


def decode_pub_frames(frames: list[bytes]) -> KvEventBatch:
    """A PUB message: [topic, seq, payload]."""
    if len(frames) != 3:
        raise KvEventDecodeError(f"PUB message must have 3 frames, got {len(frames)}")
    return decode_payload(frames[2], unpack_seq(frames[1]))


def decode_replay_frames(frames: list[bytes]) -> KvEventBatch | None:
    """A replay reply as a DEALER receives it. Returns None at END_SEQ.

    0.32: [b"", topic, seq, payload]; <=0.24: [b"", seq, payload] (a DEALER still sees the empty delimiter).
    """
    body = frames[1:] if frames and frames[0] == b"" else frames
    if len(body) == 3:
        _topic, seq_raw, payload = body
    elif len(body) == 2:
        seq_raw, payload = body
    else:
        raise KvEventDecodeError(f"replay reply must have 2 or 3 frames after the delimiter, got {len(body)}")
    seq = unpack_seq(seq_raw)
    if seq == END_SEQ:
        return None
    return decode_payload(payload, seq)
