"""SGLang's KV-cache event wire format (ZMQ + msgpack), decode and encode.

Wire (SGLang 0.5.23, `srt/disaggregation/kv_events.py`):
  PUB message  = [topic, seq (8-byte big-endian), payload]          (same frames as vLLM)
  payload      = msgpack [ts: float, events: list, attn_dp_rank: int|None]
  event        = tagged map {"type": "BlockStored", ...} (0.5.23) or tagged array ["BlockStored", ...] (older)
  BlockStored  = block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                 cache_salt, session_id, lora_name              (array order; no extra_keys/group_idx)
  BlockRemoved = block_hashes, medium;   AllBlocksCleared = no fields
  replay       = [b"", start_seq] to the ROUTER; reply [b"", topic, seq, payload] ... [b"", b"", -1, b""]

Hashes are SHA-256 prefixes sent as *signed* int64; they are normalised to unsigned 64-bit ids
(h & (2^64 - 1)) so stored, parent and removed ids agree. Medium is GPU, CPU_PINNED, DISK or
EXTERNAL. Unknown fields and unknown event types are ignored; anything malformed raises
KvEventDecodeError. The usual shape is decoded and checked by a typed msgspec decoder in C;
anything else (arrays, unknown types, odd values) by a tolerant generic path. Token ids are
checked when the router hashes them (router/hashing.py).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from router.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvEventDecodeError,
                               removal_runs, token_ids_of)

__all__ = ["END_SEQ", "decode_payload", "decode_pub_frames", "decode_replay_frames", "encode_batch"]

END_SEQ = -1
_U64 = (1 << 64) - 1
_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "cache_salt", "session_id", "lora_name")
_REMOVED = ("block_hashes", "medium")
_encoder = msgspec.msgpack.Encoder()


def _seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise KvEventDecodeError(f"sequence frame must be 8 bytes, got {len(raw)}")
    return struct.unpack(">q", raw)[0]  # signed: END_SEQ is -1; real sequences stay below 2^63


def _hash(v: Any) -> int:
    if type(v) is not int:
        raise KvEventDecodeError(f"block hash must be an int, got {type(v).__name__}")
    return v & _U64


def _hashes(v: Any) -> list[int]:
    if not isinstance(v, list):
        raise KvEventDecodeError("block_hashes must be a list")
    return [_hash(h) for h in v]


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _event(raw: Any) -> KvEvent | None:
    if isinstance(raw, dict):
        tag, f = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        f = dict(zip(_STORED if tag == "BlockStored" else _REMOVED if tag == "BlockRemoved" else (), raw[1:]))
    else:
        raise KvEventDecodeError("event is neither a tagged map nor a tagged array")
    if tag == "BlockStored":
        bs, tokens, parent = f.get("block_size"), f.get("token_ids"), f.get("parent_block_hash")
        if type(bs) is not int or bs <= 0:
            raise KvEventDecodeError("BlockStored.block_size must be a positive int")
        if not isinstance(tokens, list):
            raise KvEventDecodeError("BlockStored.token_ids must be a list")
        return BlockStored(_hashes(f.get("block_hashes")), None if parent is None else _hash(parent), tokens, bs,
                           lora_name=_opt_str(f.get("lora_name")), medium=_opt_str(f.get("medium")))
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(f.get("block_hashes")), medium=_opt_str(f.get("medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise KvEventDecodeError("event has no string type tag")
    return None


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: msgspec.Raw  # kept as msgpack: read by token_ids_of (packed for the reader, else a list)
    block_size: int
    medium: str | None = None
    lora_name: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    dp_rank: int | None = None


_typed = msgspec.msgpack.Decoder(_Batch)


def _fast(payload: bytes, seq: int, packed: bool) -> KvEventBatch | None:
    """The common shape (0.5.23 maps, known types) decoded and type-checked in C; None otherwise."""
    try:
        b = _typed.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError):
        return None
    out: list[KvEvent] = []
    for e in removal_runs(b.events, _Removed, _masked):
        if type(e) is BlockRemoved:
            out.append(e)
        elif type(e) is _Stored:
            if e.block_size <= 0:
                return None
            try:
                ids = token_ids_of(e.token_ids, packed)
            except (msgspec.DecodeError, ValueError, TypeError, RecursionError):  # not an array of ints
                return None
            p = e.parent_block_hash
            out.append(BlockStored(_masked(e.block_hashes), None if p is None else p & _U64, ids, e.block_size,
                                   lora_name=e.lora_name, medium=e.medium))
        else:
            out.append(AllBlocksCleared())
    return KvEventBatch(seq=seq, ts=b.ts, events=out, dp_rank=b.dp_rank)


def _masked(hashes: list[int]) -> list[int]:
    return [h & _U64 for h in hashes]  # SGLang sends signed ids


def decode_payload(payload: bytes, seq: int = 0, packed_ids: bool = False) -> KvEventBatch:
    """One [ts, events, attn_dp_rank] payload. Raises KvEventDecodeError on anything malformed.

    `packed_ids`: a BlockStored's token ids as a memoryview of native uint32 where they fit (the KV-event reader,
    router/events.py: no int object per token); otherwise, and always on the generic path, a list of ints."""
    fast = _fast(payload, seq, packed_ids)
    if fast is not None:
        return fast
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise KvEventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventDecodeError("event batch must be an array [ts, events, dp_rank?]")
    ts, dp = raw[0], raw[2] if len(raw) > 2 else None
    if type(ts) not in (int, float) or (dp is not None and type(dp) is not int):
        raise KvEventDecodeError("batch ts must be a number and dp_rank an int or nil")
    return KvEventBatch(seq=seq, ts=float(ts), events=[e for e in map(_event, raw[1]) if e is not None], dp_rank=dp)


def decode_pub_frames(frames: list[bytes]) -> KvEventBatch:
    if len(frames) != 3:
        raise KvEventDecodeError(f"PUB message must have 3 frames, got {len(frames)}")
    return decode_payload(frames[2], _seq(frames[1]))


def decode_replay_frames(frames: list[bytes]) -> KvEventBatch | None:
    """A replay reply as a DEALER receives it; None at END_SEQ."""
    body = frames[1:] if frames and frames[0] == b"" else frames
    if len(body) not in (2, 3):
        raise KvEventDecodeError(f"replay reply must have 2 or 3 frames after the delimiter, got {len(body)}")
    seq = _seq(body[-2])
    return None if seq == END_SEQ else decode_payload(body[-1], seq)


def encode_batch(ts: float, events: list[KvEvent], dp_rank: int | None = 0, signed: bool = True) -> bytes:
    """Encode events as SGLang 0.5.23 does (tagged maps; ids as signed int64). For tests and the sim."""

    def sid(h: int) -> int:
        return h - (1 << 64) if signed and h >= 1 << 63 else h

    wire: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            wire.append({"type": "BlockStored", "block_hashes": [sid(h) for h in ev.block_hashes],
                         "parent_block_hash": None if ev.parent_block_hash is None else sid(ev.parent_block_hash),
                         "token_ids": ev.token_ids, "block_size": ev.block_size, "lora_id": None,
                         "medium": ev.medium or "GPU", "cache_salt": None, "session_id": None, "lora_name": ev.lora_name})
        elif isinstance(ev, BlockRemoved):
            wire.append({"type": "BlockRemoved", "block_hashes": [sid(h) for h in ev.block_hashes], "medium": ev.medium or "GPU"})
        else:
            wire.append({"type": "AllBlocksCleared"})
    return _encoder.encode([ts, wire, dp_rank])
