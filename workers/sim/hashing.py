"""vLLM's prefix-cache block hashing (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`, 0.32).

    H(obj)        = sha256(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))            # 32 bytes
    NONE_HASH     = H(seed),  seed = "vllm-none-hash" (or PYTHONHASHSEED when the CLI sees it set)
    block_hash[i] = H((block_hash[i-1] or NONE_HASH, tuple(tokens[i*B:(i+1)*B]), None))
    published     = int.from_bytes(block_hash, "big") & (2**64 - 1)              # KV events

Only full blocks are hashed; `extra_keys` is always None here (no LoRA, multimodal or cache salt).
Checked against a live vLLM 0.32 server: tokens 1..64 with block size 32 publish
[11290800355336220572, 11189021207153552290].
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

__all__ = ["DEFAULT_SEED", "BlockHasher", "sha256_pickle", "to_external"]

DEFAULT_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1
_PROTO = pickle.HIGHEST_PROTOCOL


def sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTO)).digest()


def to_external(block_hash: bytes) -> int:
    """The unsigned 64-bit int vLLM publishes for a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(block_hash, "big") & _MASK64


class BlockHasher:
    """Chained block hashes of one block size and seed."""

    def __init__(self, block_size: int, seed: str = DEFAULT_SEED) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.none_hash = sha256_pickle(seed)

    def hash_block(self, parent: bytes | None, block_tokens: Sequence[int]) -> bytes:
        return sha256_pickle((parent or self.none_hash, tuple(block_tokens), None))

    def extend(self, hashes: list[bytes], token_ids: Sequence[int]) -> list[bytes]:
        """Append the hashes of every newly full block of `token_ids` to `hashes` (in place) and return it."""
        bs = self.block_size
        n_full = len(token_ids) // bs
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), n_full):
            parent = self.hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def hash_all(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.extend([], token_ids)
