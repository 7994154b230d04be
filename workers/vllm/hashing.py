"""vLLM's prefix-cache block hashes, recomputed outside the engine (vllm/v1/core/kv_cache_utils.py).

vLLM 0.32 with the default `--prefix-caching-hash-algo sha256`, `vllm/v1/core/kv_cache_utils.py`:

    hash_fn(obj)      = sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    NONE_HASH         = hash_fn(seed)            seed = $PYTHONHASHSEED if set, else "vllm-none-hash"
    h[0]              = hash_fn((NONE_HASH, tuple(tokens[0:B]), extra_keys_0))
    h[i]              = hash_fn((h[i-1], tuple(tokens[i*B:(i+1)*B]), extra_keys_i))

Only full blocks are hashed; the chain carries the full 32-byte digests. What KV events publish
(with the default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) is `int.from_bytes(digest, "big") & (2**64-1)`.
`extra_keys` is None for plain text requests (no LoRA, multimodal input, cache salt or prompt embeds); else
(`generate_block_hash_extra_keys`; `vllm_extra_keys` here) the tuple, in this order, of

    ("lora", lora_name, lora_path)                 every block of a LoRA request
    ("mm", identifier, offset - block start)       each multimodal item overlapping the block (router/mm_hashing.py)
    ("cache_salt", salt)                           the first block only

and KV events publish them untagged (`to_event_extra_keys`): the bare lora name or salt, (identifier, offset)
pairs. Golden values from vLLM's own functions: tests/fixtures/vllm_extra_keys_golden.json.

vLLM <= 0.28 seeded NONE_HASH from os.urandom unless PYTHONHASHSEED was set, so there the
published hashes cannot be recomputed without fixing the seed.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from router.mm_hashing import block_mm_keys  # vLLM's walk over the multimodal items (_gen_mm_extra_hash_keys)

__all__ = ["DEFAULT_SEED", "sha256_pickle", "none_hash", "vllm_block_digests", "vllm_block_hashes", "to_external",
           "vllm_extra_keys", "to_event_extra_keys"]

DEFAULT_SEED = "vllm-none-hash"
_U64 = (1 << 64) - 1


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's `sha256` hash function: SHA-256 of the highest-protocol pickle of `obj`."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    """The parent digest of the first block of every sequence."""
    return sha256_pickle(seed)


def to_external(digest: bytes) -> int:
    """A block digest as KV events publish it: the low 64 bits of the big-endian integer."""
    return int.from_bytes(digest, "big") & _U64


def vllm_block_digests(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_SEED,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
) -> list[bytes]:
    """The full 32-byte chained digests of every full block of `token_ids`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = none_hash(seed)
    digests: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        block = tuple(int(t) for t in token_ids[i * block_size : (i + 1) * block_size])
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        parent = sha256_pickle((parent, block, extra))
        digests.append(parent)
    return digests


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_SEED,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
) -> list[int]:
    """The block hashes vLLM 0.32 publishes in BlockStored events for a prompt of `token_ids`."""
    return [to_external(d) for d in vllm_block_digests(token_ids, block_size, seed=seed, extra_keys=extra_keys)]


def vllm_extra_keys(
    num_tokens: int,
    block_size: int,
    *,
    lora: tuple[str, str] | None = None,
    mm_items: Sequence[tuple[str, int, int]] = (),
    cache_salt: str | None = None,
) -> list[tuple[Any, ...] | None]:
    """vLLM 0.32's per-block extra keys of a prompt of `num_tokens`: `lora` = (name, path), `mm_items` =
    (identifier, offset, length) sorted by offset. One entry per full block, None where the block has none."""
    mm = block_mm_keys(num_tokens, block_size, mm_items)
    out: list[tuple[Any, ...] | None] = []
    for i, keys in enumerate(mm):
        extra: list[tuple[Any, ...]] = [("lora", lora[0], lora[1])] if lora else []
        extra += [("mm", ident, off) for ident, off in keys or ()]
        if i == 0 and cache_salt:
            extra.append(("cache_salt", cache_salt))
        out.append(tuple(extra) if extra else None)
    return out


def to_event_extra_keys(extra_keys: Sequence[tuple[Any, ...] | None]) -> list[tuple[Any, ...] | None] | None:
    """vLLM's `to_event_extra_keys`: the untagged per-block keys KV events carry (None when no block has any)."""
    if not extra_keys:
        return None
    return [None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys) for keys in extra_keys]
