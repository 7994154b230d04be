"""Multimodal block hashes: images and audio mixed into the router's chained hashes, as vLLM keys its blocks.

A multimodal item (an image, an audio clip) enters the prompt as a run of placeholder tokens: the same ids for
every image, so tokens alone would let two different images share blocks. vLLM 0.32 therefore gives each
block extra keys (`vllm/v1/core/kv_cache_utils.py`, `_gen_mm_extra_hash_keys`): for every item whose
placeholder run [offset, offset + length) overlaps the block [start, start + B),

    ("mm", identifier, offset - start)        in item order (items sorted by offset)

(the offset relative to the block, negative when the item began in an earlier block), so the same item shares
blocks only at the same place, and different items never do. `block_mm_keys` computes those per-block keys
exactly (tested against vLLM's own function: tests/unit/router/test_mm_hashing.py); KV events publish them
untagged as (identifier, offset) pairs (workers/vllm/kv_events.py decodes them to the same tuples). The walk
itself lives in workers/multimodal.py, shared with the sim engine and workers/vllm/hashing.py.

The router's hash of a block with keys (its own xxh3 scheme, router/hashing.py) appends them to the token bytes,
as Dynamo appends a block's mm hashes (reference: lib/kv-router/src/protocols.rs):

    local[i] = xxh3_64(LE u32 tokens[i*B:(i+1)*B] || for each key: LE u64 xxh3_64(identifier) || LE i64 offset, seed)

and chains exactly like a text block, so a block without keys hashes as it always did (a text prefix before
the first image still matches text-only prompts). The chain runs in Python here (a request with images is
hashed once; a few µs per block).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from functools import lru_cache

import xxhash

from router.errors import BlockHashError
from router.hashing import BASE_SEED, lora_seed

__all__ = ["MmItem", "MmKeys", "block_mm_keys", "mm_block_hashes", "mm_block_hashes_view"]

MmKeys = tuple[tuple[str, int], ...]  # one block's (identifier, offset relative to the block start) pairs
MmItem = tuple[str, int, int]  # one multimodal item: (identifier, offset of its placeholder run, run length)

_xxh3 = xxhash.xxh3_64_intdigest
_pair = struct.Struct("<QQ")
_key = struct.Struct("<Qq")


@lru_cache(maxsize=4096)
def _ident(identifier: str) -> int:
    return _xxh3(identifier.encode("utf-8", "surrogatepass"), 0)


def mm_block_hashes(tokens: Sequence[int], block_size: int, lora_name: str | None = None,
                    keys: Sequence[MmKeys | None] | None = None, parent: int | None = None) -> list[int]:
    """The router's chained hashes of the full blocks of `tokens`, block i's `keys[i]` mixed in (see the header).

    Equal to router.hashing.block_hashes wherever no block has keys. Raises BlockHashError for token ids outside
    [0, 2^32) or block_size < 1."""
    if block_size <= 0:
        raise BlockHashError(f"block_size must be positive, got {block_size}")
    n = len(tokens) // block_size
    try:
        buf = array("I", tokens[: n * block_size])
    except (TypeError, OverflowError) as exc:
        raise BlockHashError(f"cannot hash token blocks: {exc}") from exc
    if buf.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte unsigned int
        raise BlockHashError("array('I') is not 32-bit here")
    if struct.pack("=I", 1) != struct.pack("<I", 1):
        buf.byteswap()
    raw = buf.tobytes()
    seed = BASE_SEED if not lora_name else lora_seed(lora_name)
    step = 4 * block_size
    prev = parent
    out: list[int] = []
    for i in range(n):
        data = raw[i * step : (i + 1) * step]
        k = keys[i] if keys is not None and i < len(keys) else None
        if k:
            try:
                data += b"".join(_key.pack(_ident(ident), off) for ident, off in k)
            except (TypeError, struct.error) as exc:
                raise BlockHashError(f"bad multimodal key in block {i}: {exc}") from exc
        local = _xxh3(data, seed)
        prev = local if prev is None else _xxh3(_pair.pack(prev, local), BASE_SEED)
        out.append(prev)
    return out


def mm_block_hashes_view(tokens: Sequence[int], block_size: int, lora_name: str | None,
                         items: Sequence[tuple[str, int, int]]) -> memoryview:
    """A prompt's hashes with its multimodal items, as the read-only uint64 view the router's hot path reads."""
    if block_size <= 0:
        raise BlockHashError(f"block_size must be positive, got {block_size}")
    keys = block_mm_keys(len(tokens), block_size, items)
    return memoryview(array("Q", mm_block_hashes(tokens, block_size, lora_name, keys)).tobytes()).cast("Q")


def block_mm_keys(num_tokens: int, block_size: int, items: Sequence[MmItem]) -> list[tuple[tuple[str, int], ...] | None]:
    """Per full block of a `num_tokens` prompt: (identifier, item offset - block start) of each item overlapping it
    (None for a block with none); `items` sorted by offset. vLLM's `_gen_mm_extra_hash_keys` block by block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = num_tokens // block_size
    out: list[tuple[tuple[str, int], ...] | None] = [None] * n_blocks
    for ident, offset, length in items:
        if length <= 0:
            continue
        for b in range(max(0, offset // block_size), min(n_blocks - 1, (offset + length - 1) // block_size) + 1):
            key = (ident, offset - b * block_size)
            prev = out[b]
            out[b] = (*prev, key) if prev else (key,)
    return out
