"""Engine-neutral KV-cache events, as the router's index consumes them.

Each backend decodes its own wire format (vLLM/SGLang ZMQ msgpack, TensorRT-LLM JSON) into these.
Block hashes are the *engine's* ids, normalised to Python ints; the router maps them to its own
hashes, so any engine's hash algorithm works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent", "KvEventBatch", "KvEventDecodeError",
           "removal_runs", "token_ids_of"]


class KvEventDecodeError(ValueError):
    """A frame or event could not be decoded; the consumer logs and skips it."""


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    # a list of ints, or (a codec's decode_payload with packed_ids=True: the KV-event reader's) a memoryview of
    # native uint32, which the index's hashing reads without an int object per token (token_ids_of)
    token_ids: list[int] | memoryview
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    # per block: the multimodal items it covers, ((identifier, item offset - block start), ...) or None; None when
    # no block has any (workers/multimodal.py; the router mixes them into its hashes, router/mm_hashing.py)
    mm_keys: list[tuple[tuple[str, int], ...] | None] | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None
    # how many engine events this stands for: vLLM publishes one BlockRemoved per evicted block, and its codec merges a
    # run of them (one medium, ints checked) into one; removals commute, so the index ends the same (counted as many)
    events: int = 1


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KvEventBatch:
    seq: int
    ts: float
    events: list[KvEvent] = field(default_factory=list)
    dp_rank: int | None = None


_ids_decoder = msgspec.msgpack.Decoder(list[int])
try:
    from router._kvcore import msgpack_u32 as _msgpack_u32
except ImportError:  # not built: decoded to a list (router/hashing.py warns once that the extension is missing)
    _msgpack_u32 = None


def removal_runs(events: Iterable[Any], removed: type, mask: Callable[[list[int]], list[int]]) -> Iterator[Any]:
    """`events` as they come, except that each run of consecutive `removed` events (a codec's typed removal, whose ids
    are ints: none can be refused) of one medium comes as one BlockRemoved of `mask(all their ids)` that counts as
    the events it stands for. vLLM sends one removal per evicted block (SGLang one per evicted node)."""
    run: list = []
    for ev in events:
        if type(ev) is removed:
            if run and ev.medium != run[0].medium:
                yield _merged(run, mask)
                run = []
            run.append(ev)
            continue
        if run:
            yield _merged(run, mask)
            run = []
        yield ev
    if run:
        yield _merged(run, mask)


def _merged(run: list, mask: Callable[[list[int]], list[int]]) -> BlockRemoved:
    hashes = run[0].block_hashes if len(run) == 1 else [h for ev in run for h in ev.block_hashes]
    return BlockRemoved(mask(hashes), run[0].medium, len(run))


def token_ids_of(raw: msgspec.Raw, packed: bool) -> list[int] | memoryview:
    """A BlockStored's token ids, kept as msgpack by a codec's typed decoder (vLLM's, SGLang's): with `packed`, a
    memoryview of native uint32 (when all are in [0, 2^32)), read in C; else, or past that range, a list of ints.
    Raises msgspec.ValidationError (or DecodeError) when they are not an array of ints: the codec's generic path then
    decides, and explains."""
    if packed and _msgpack_u32 is not None:
        buf = _msgpack_u32(raw)
        if buf is not None:
            return memoryview(buf).cast("I")
    return _ids_decoder.decode(raw)  # out-of-range ids stay ints: the index refuses them (BlockHashError)
