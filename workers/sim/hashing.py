"""vLLM's prefix-cache block hashing (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`, 0.32).

    H(obj)        = sha256(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))            # 32 bytes
    NONE_HASH     = H(seed),  seed = "vllm-none-hash" (or PYTHONHASHSEED when the CLI sees it set)
    block_hash[i] = H((block_hash[i-1] or NONE_HASH, tuple(tokens[i*B:(i+1)*B]), None))
    published     = int.from_bytes(block_hash, "big") & (2**64 - 1)              # KV events

Only full blocks are hashed. `extra_keys` is None for a plain request; a request for a LoRA adapter or with
images/audio keeps its hashes in a `RequestHashes` list, which knows the adapter (name, path) and the items and
gives each block vLLM's keys (`("lora", name, path)`, `("mm", identifier, offset)`: workers/vllm/hashing.py), so
the sim's cache never shares blocks between adapters or images, and its events carry the same extra keys.
Checked against a live vLLM 0.32 server: tokens 1..64 with block size 32 publish
[11290800355336220572, 11189021207153552290].
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from router.mm_hashing import MmItem, block_mm_keys

__all__ = ["DEFAULT_SEED", "BlockHasher", "RequestHashes", "sha256_pickle", "to_external"]

DEFAULT_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1
_PROTO = pickle.HIGHEST_PROTOCOL


def sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTO)).digest()


def to_external(block_hash: bytes) -> int:
    """The unsigned 64-bit int vLLM publishes for a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(block_hash, "big") & _MASK64


class RequestHashes(list):
    """A request's block hashes (a plain list to everyone else) plus what its blocks are keyed by beyond tokens:
    the LoRA adapter (name, path) and the multimodal items (identifier, offset, length), sorted by offset."""

    __slots__ = ("lora", "mm_items", "_mm")

    def __init__(self, lora: tuple[str, str] | None = None, mm_items: Sequence[MmItem] = ()) -> None:
        super().__init__()
        self.lora = lora
        self.mm_items = tuple(mm_items)
        self._mm: list | None = None

    @property
    def lora_name(self) -> str | None:
        return self.lora[0] if self.lora else None

    def mm_keys(self, start: int, end: int, block_size: int) -> list[tuple[tuple[str, int], ...] | None] | None:
        """(identifier, offset) keys of blocks [start, end); None when none of them has any."""
        if not self.mm_items:
            return None
        if self._mm is None:
            last = max(off + n for _, off, n in self.mm_items)
            self._mm = block_mm_keys(-(-last // block_size) * block_size, block_size, self.mm_items)
        keys = [self._mm[i] if i < len(self._mm) else None for i in range(start, end)]
        return keys if any(keys) else None

    def extra_keys(self, i: int, block_size: int) -> tuple[Any, ...] | None:
        """vLLM's tagged extra keys of block i (`generate_block_hash_extra_keys`, no salt)."""
        extra: list[tuple[Any, ...]] = [("lora", self.lora[0], self.lora[1])] if self.lora else []
        mm = self.mm_keys(i, i + 1, block_size)
        if mm:
            extra += [("mm", ident, off) for ident, off in mm[0] or ()]
        return tuple(extra) if extra else None


class BlockHasher:
    """Chained block hashes of one block size and seed."""

    def __init__(self, block_size: int, seed: str = DEFAULT_SEED) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.none_hash = sha256_pickle(seed)

    def hash_block(self, parent: bytes | None, block_tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        return sha256_pickle((parent or self.none_hash, tuple(block_tokens), extra_keys))

    def extend(self, hashes: list[bytes], token_ids: Sequence[int]) -> list[bytes]:
        """Append the hashes of every newly full block of `token_ids` to `hashes` (in place) and return it;
        a `RequestHashes` list gives each block its extra keys."""
        bs = self.block_size
        n_full = len(token_ids) // bs
        parent = hashes[-1] if hashes else None
        keyed = hashes if type(hashes) is RequestHashes else None
        for i in range(len(hashes), n_full):
            parent = self.hash_block(parent, token_ids[i * bs : (i + 1) * bs], keyed.extra_keys(i, bs) if keyed is not None else None)
            hashes.append(parent)
        return hashes

    def hash_all(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.extend([], token_ids)
