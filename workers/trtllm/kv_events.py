"""TensorRT-LLM's KV-cache events (JSON over HTTP), decoded into engine-neutral events.

Source: `POST /kv_cache_events` on trtllm-serve drains the engine's event queue and answers a JSON
list (serialiser `tensorrt_llm._utils.KVCacheEventSerializer`):

    {"event_id": int, "window_size": int, ["attention_dp_rank": int], "data": one of
      {"type": "created", "num_blocks_per_cache_level": [...]}                 -> AllBlocksCleared
      {"type": "stored", "parent_hash": int|null, "blocks": [{"type": "stored_block",
          "block_hash": int, "tokens": [{"type": "unique_token", "token_id": int,
          "token_extra_id": int}], "cache_level": int, "priority": int}]}      -> BlockStored
      {"type": "removed", "block_hashes": [int]}                               -> BlockRemoved
      {"type": "updated", "block_hash": int, "cache_level": {"type": "event_diff",
          "new_value": int, "old_value": int}, "priority": {...}}}             -> see below

Each event becomes one KvEventBatch with seq = event_id (the ingestor checks for gaps; there is
no replay, so a gap means a purge). Block size = the first stored block's token count; trailing
blocks of another size (a partial block) are dropped. A stored event whose blocks are not all at
cache level 0 (primary/GPU) gets medium "CPU" (not indexed). "updated" moving a block off level 0
becomes BlockRemoved; moving back to level 0 is ignored (its tokens are not resent). Ids are
normalised to unsigned 64-bit. `decode_events` never raises for one bad event: it returns a
KvEventDecodeError in that event's place.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvEventDecodeError

__all__ = ["KV_EVENTS_PATH", "decode_event", "decode_events", "encode_events"]

KV_EVENTS_PATH = "/kv_cache_events"
_U64 = (1 << 64) - 1


def _id(v: Any, what: str) -> int:
    if type(v) is not int:
        raise KvEventDecodeError(f"{what} must be an int, got {type(v).__name__}")
    return v & _U64


def _stored(d: dict) -> BlockStored:
    blocks = d.get("blocks")
    if not isinstance(blocks, list):
        raise KvEventDecodeError("stored.blocks must be a list")
    parent = d.get("parent_hash")
    hashes: list[int] = []
    tokens: list[int] = []
    size = None
    primary = True
    for b in blocks:
        if not isinstance(b, dict) or not isinstance(b.get("tokens"), list):
            raise KvEventDecodeError("stored block must be a map with a tokens list")
        toks = [t.get("token_id") if isinstance(t, dict) else None for t in b["tokens"]]
        if size is None:
            size = len(toks)
        if len(toks) != size or not size:
            break  # a partial (or empty) block: not indexable, nor anything after it
        hashes.append(_id(b.get("block_hash"), "block_hash"))
        tokens.extend(toks)
        primary = primary and b.get("cache_level", 0) in (0, None)
    return BlockStored(hashes, None if parent is None else _id(parent, "parent_hash"), tokens, size or 1,
                       medium="GPU" if primary else "CPU")


def decode_event(raw: Any) -> KvEventBatch:
    """One serialised event -> a batch of zero or one engine-neutral events (seq = event_id)."""
    if not isinstance(raw, dict):
        raise KvEventDecodeError("event must be a JSON object")
    seq = raw.get("event_id")
    if type(seq) is not int or seq < 0:
        raise KvEventDecodeError("event_id must be a non-negative int")
    d = raw.get("data")
    kind = d.get("type") if isinstance(d, dict) else None
    dp = raw.get("attention_dp_rank")
    ev: KvEvent | None = None
    if kind == "created":
        ev = AllBlocksCleared()
    elif kind == "stored":
        ev = _stored(d)
    elif kind == "removed":
        hs = d.get("block_hashes")
        if not isinstance(hs, list):
            raise KvEventDecodeError("removed.block_hashes must be a list")
        ev = BlockRemoved([_id(h, "block_hash") for h in hs], medium="GPU")
    elif kind == "updated":
        level = d.get("cache_level")
        new = level.get("new_value") if isinstance(level, dict) else None
        if type(new) is int and new != 0:
            ev = BlockRemoved([_id(d.get("block_hash"), "block_hash")], medium="GPU")
    elif not isinstance(kind, str):
        raise KvEventDecodeError("event data has no string type")
    return KvEventBatch(seq=seq, ts=0.0, events=[ev] if ev is not None else [], dp_rank=dp if type(dp) is int else None)


def decode_events(body: bytes | str | list) -> list[KvEventBatch | KvEventDecodeError]:
    """A /kv_cache_events response -> per event, its batch or the error that made it unreadable."""
    if isinstance(body, (bytes, str)):
        try:
            body = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:
            return [KvEventDecodeError(f"response is not JSON: {exc}")]
    if not isinstance(body, list):
        return [KvEventDecodeError("response must be a JSON list of events")]
    out: list[KvEventBatch | KvEventDecodeError] = []
    for raw in body:
        try:
            out.append(decode_event(raw))
        except KvEventDecodeError as exc:
            out.append(exc)
    return out


def encode_events(batches: list[tuple[int, KvEvent]], window_size: int = 0) -> bytes:
    """(event_id, event) pairs -> the JSON trtllm-serve answers. For tests and the sim."""
    out = []
    for eid, ev in batches:
        if isinstance(ev, BlockStored):
            bs = ev.block_size
            data = {"type": "stored", "parent_hash": ev.parent_block_hash, "blocks": [
                {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                 "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ev.token_ids[i * bs:(i + 1) * bs]]}
                for i, h in enumerate(ev.block_hashes)]}
        elif isinstance(ev, BlockRemoved):
            data = {"type": "removed", "block_hashes": ev.block_hashes}
        else:
            data = {"type": "created", "num_blocks_per_cache_level": [0, 0]}
        out.append({"event_id": eid, "data": data, "window_size": window_size})
    return msgspec.json.encode(out)
