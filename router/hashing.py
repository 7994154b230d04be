"""Token blocks -> chained 64-bit block hashes (the router's own, engine-independent ids).

    seed      = 1337                                  (BASE_SEED)
              = (1337 + xxh3_64(lora_name)) mod 2^64  with a LoRA adapter
    local[i]  = xxh3_64(LE u32 tokens[i*B : (i+1)*B], seed)       full blocks only
    seq[0]    = local[0]                                           from the root
              = xxh3_64(LE u64 parent || LE u64 local[0], 1337)    continuing after `parent`
    seq[i]    = xxh3_64(LE u64 seq[i-1] || LE u64 local[i], 1337)

This is Dynamo's scheme (`lib/kv-router/src/protocols.rs`), so the
same prompt gives the same ids in both. Each id names the whole prefix up to its block, so a
prefix index can be a flat map. A trailing partial block is never hashed.

The work is done by the C extension `router._kvcore` (about 10 µs for 4,096 tokens from a Python
list); if it is not built, an identical pure-Python version (`xxhash` package) is used and a
warning is logged once. `IMPLEMENTATION` says which one is live.
"""

from __future__ import annotations

import logging
import struct
import sys
from array import array
from functools import lru_cache

import xxhash

from router.errors import BlockHashError

__all__ = ["BASE_SEED", "IMPLEMENTATION", "block_hashes", "block_hashes_view", "lora_seed", "py_chain_hashes"]

log = logging.getLogger("kvyard.router.hashing")

BASE_SEED = 1337
_U64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest
_pair = struct.Struct("<QQ")


def py_chain_hashes(tokens, block_size: int, seed: int = BASE_SEED, parent: int | None = None, packed: bool = False):
    """Pure-Python twin of `_kvcore.chain_hashes` (same values, same errors)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if isinstance(tokens, (list, tuple)):  # only full blocks are read, as in C
        buf = array("I", tokens[: len(tokens) - len(tokens) % block_size])  # TypeError / OverflowError as in C
    else:
        view = memoryview(tokens)
        if view.itemsize != 4 or view.format.lstrip("=@<") not in ("I", "L"):
            raise TypeError("a token buffer must hold native uint32 items")
        buf = array("I", view.cast("B").tobytes())
    if sys.byteorder == "big":
        buf.byteswap()
    raw = buf.tobytes()
    step = 4 * block_size
    out: list[int] = []
    prev = parent
    for off in range(0, (len(buf) // block_size) * step, step):
        local = _xxh3(raw[off : off + step], seed)
        prev = local if prev is None else _xxh3(_pair.pack(prev, local), BASE_SEED)
        out.append(prev)
    return array("Q", out).tobytes() if packed else out


try:
    from router._kvcore import chain_hashes as _chain_hashes

    IMPLEMENTATION = "c"
except ImportError:  # extension not built: identical values, slower
    _chain_hashes = py_chain_hashes
    IMPLEMENTATION = "python"
    log.warning("router._kvcore is not built; block hashing uses the pure-Python fallback (about 100x slower)")


@lru_cache(maxsize=256)
def lora_seed(lora_name: str | None) -> int:
    """Hash seed for a LoRA adapter name (None or "" -> the base seed)."""
    if not lora_name:
        return BASE_SEED
    return (BASE_SEED + _xxh3(lora_name.encode(), 0)) & _U64


def block_hashes(tokens, block_size: int, lora_name: str | None = None, parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `tokens` (list/tuple of ints, or a uint32 buffer).

    `parent` continues a chain (the hash of the block before tokens[0]); None starts at the root.
    Raises BlockHashError for token ids outside [0, 2^32) or block_size < 1.
    """
    try:
        return _chain_hashes(tokens, block_size, BASE_SEED if not lora_name else lora_seed(lora_name), parent)
    except (TypeError, OverflowError, ValueError) as exc:
        raise BlockHashError(f"cannot hash token blocks: {exc}") from exc


def block_hashes_view(tokens, block_size: int, lora_name: str | None = None) -> memoryview:
    """The same hashes as a read-only uint64 memoryview (indexing and iteration give ints).

    The router's hot path uses this: no int object per block, and the index reads it directly.
    """
    try:
        raw = _chain_hashes(tokens, block_size, BASE_SEED if not lora_name else lora_seed(lora_name), None, True)
    except (TypeError, OverflowError, ValueError) as exc:
        raise BlockHashError(f"cannot hash token blocks: {exc}") from exc
    return memoryview(raw).cast("Q")
