"""Paged KV blocks with prefix caching: vLLM v1's `BlockPool` + `KVCacheManager` for one attention group.

Model (vLLM 0.32, `vllm/v1/core/block_pool.py`, `kv_cache_manager.py`):
- `num_gpu_blocks` blocks of `block_size` tokens; block 0 is vLLM's reserved null block, so
  `num_gpu_blocks - 1` are usable and `usage = 1 - free / (num_gpu_blocks - 1)`.
- Every block has a refcount. A block whose refcount drops to 0 goes on the *free queue* but keeps
  its hash, so it can still serve a prefix hit (which takes it off the queue) until it is evicted.
- Free queue order = eviction order (front first). `free(req)` releases a request's blocks in reverse
  (tail blocks first); unhashed blocks go to the front (reused first), hashed ones to the back (LRU).
  Allocation pops from the front; popping a hashed block evicts it -> one `BlockRemoved` per hash.
- A request's prefix hit is the longest run of its leading full-block hashes present in the cache,
  capped at `(num_tokens - 1) // block_size` blocks (the last token is always recomputed).
- `allocate_slots` caches the blocks that become full once the step's tokens are computed, emitting
  one `BlockStored` per call covering all its new full blocks (parent = previous block's hash, or
  None for the first block). Prefix hits emit nothing. Two requests that compute the same block
  concurrently both cache it (duplicates), exactly like vLLM.
- `reset_prefix_cache` (only when no block is in use) drops every hash -> `AllBlocksCleared`.

Block hashes are opaque keys: vLLM's sha256 bytes (workers/sim/hashing.py) by default, published as
`to_external(hash)`; a replay may hash blocks its own way (any hashable key) and pass `external` to publish them,
and `coalesce_removals` to publish a run of evictions as one BlockRemoved (the same index update, fewer events).
Pure and synchronous; events accumulate until `take_events()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from workers.sim.free_queue import FreeBlockQueue
from workers.sim.hashing import RequestHashes, to_external

__all__ = ["KvBlockManager"]

MEDIUM = "GPU"


class KvBlockManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, *, enable_caching: bool = True, enable_events: bool = True,
                 external: Callable[[Any], int] = to_external, coalesce_removals: bool = False) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is reserved)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self._external = external  # block hash -> the 64-bit id its KV events carry
        # consecutive evictions as one BlockRemoved of many blocks (the replay's: the index ends the same); off, one
        # event per evicted block, as vLLM publishes them
        self.coalesce_removals = coalesce_removals
        self.ref_cnt = [0] * num_gpu_blocks
        self.block_hash: list[Any] = [None] * num_gpu_blocks
        # front = next to allocate / evict; block 0 (null block) is never free
        self._free = FreeBlockQueue(num_gpu_blocks, range(1, num_gpu_blocks))
        self._cached: dict[Any, list[int]] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}
        self._events: list[KvEvent] = []

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_gpu_blocks - 1)

    def free_queue(self) -> list[int]:
        """Block ids in eviction order (tests and debugging)."""
        return list(self._free)

    def cached_hashes(self) -> set[bytes]:
        return set(self._cached)

    def get_computed_blocks(self, block_hashes: Sequence[bytes], num_tokens: int) -> tuple[list[int], int]:
        """Longest cached prefix of a request: (block ids, number of computed tokens). Takes no refs."""
        if not self.enable_caching:
            return [], 0
        max_blocks = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        hit: list[int] = []
        for i in range(max_blocks):
            ids = self._cached.get(block_hashes[i])
            if not ids:
                break
            hit.append(ids[0])
        return hit, len(hit) * self.block_size

    # ---- allocation ----------------------------------------------------------------------------
    def can_fit(self, req_id: str, num_tokens: int, new_computed_blocks: Sequence[int] = ()) -> bool:
        """Would all `num_tokens` of a request fit now? (vLLM 0.32's `scheduler_reserve_full_isl`
        admission check, applied to waiting requests before their first chunk is allocated.)"""
        have = len(self.req_blocks.get(req_id, ())) + len(new_computed_blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if self.ref_cnt[b] == 0)
        return max(0, -(-num_tokens // self.block_size) - have) + evictable_hits <= len(self._free)

    def allocate_slots(
        self,
        req_id: str,
        all_token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        max_model_len: int | None = None,
        cache: bool = True,
    ) -> bool:
        """Give `req_id` room for `num_new_tokens` more tokens after `num_computed_tokens` (which
        already includes the prefix hit `new_computed_blocks`). False (and no change) if blocks run out.
        `cache=False` allocates without caching the new full blocks (KV still to arrive from a remote
        prefill: `cache_blocks` caches them once it has)."""
        bs = self.block_size
        blocks = self.req_blocks.get(req_id)
        if blocks is not None and not new_computed_blocks:  # fast path: a running request's next tokens
            need_tokens = num_computed_tokens + num_new_tokens
            if max_model_len is not None and need_tokens > max_model_len:
                need_tokens = max_model_len
            if -(-need_tokens // bs) <= len(blocks):
                if self.enable_caching and cache:
                    n_full = min(num_computed_tokens + num_new_tokens, len(all_token_ids)) // bs
                    if n_full > self._num_cached.get(req_id, 0):
                        self._cache_full_blocks(req_id, blocks, all_token_ids, block_hashes, n_full)
                return True
        if blocks is None:
            blocks = self.req_blocks[req_id] = []
        need_tokens = num_computed_tokens + num_new_tokens
        if max_model_len is not None:
            need_tokens = min(need_tokens, max_model_len)
        num_new_blocks = max(0, -(-need_tokens // bs) - len(blocks) - len(new_computed_blocks))
        evictable_hits = sum(1 for b in new_computed_blocks if self.ref_cnt[b] == 0)
        if num_new_blocks + evictable_hits > len(self._free):
            if not blocks:
                del self.req_blocks[req_id]
            return False
        if new_computed_blocks:
            if not blocks:
                self._num_cached[req_id] = len(new_computed_blocks)
            for b in new_computed_blocks:
                if self.ref_cnt[b] == 0:
                    self._free.remove(b)
                self.ref_cnt[b] += 1
            blocks.extend(new_computed_blocks)
        for _ in range(num_new_blocks):
            b = self._free.popleft()
            self._evict(b)
            self.ref_cnt[b] = 1
            blocks.append(b)
        if self.enable_caching and cache:
            n_tokens = min(num_computed_tokens + num_new_tokens, len(all_token_ids))
            self._cache_full_blocks(req_id, blocks, all_token_ids, block_hashes, n_tokens // bs)
        return True

    def cache_blocks(self, req_id: str, all_token_ids: Sequence[int], block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Cache a request's full blocks up to `num_tokens` (KV that arrived from a remote prefill:
        one BlockStored, like vLLM's `cache_blocks` after a finished receive)."""
        blocks = self.req_blocks.get(req_id)
        if blocks and self.enable_caching:
            self._cache_full_blocks(req_id, blocks, all_token_ids, block_hashes, min(num_tokens, len(all_token_ids)) // self.block_size)

    def free(self, req_id: str) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first)."""
        blocks = self.req_blocks.pop(req_id, None)
        self._num_cached.pop(req_id, None)
        if not blocks:
            return
        front: list[int] = []
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None or not self.enable_caching:
                    front.append(b)
                else:
                    self._free.append(b)  # back of the queue: evicted last (LRU)
        for b in reversed(front):  # prepend, keeping `front` order at the head
            self._free.appendleft(b)

    def reset_prefix_cache(self) -> bool:
        if len(self._free) != self.num_gpu_blocks - 1:
            return False
        self._cached.clear()
        self.block_hash = [None] * self.num_gpu_blocks
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    # ---- internals -----------------------------------------------------------------------------
    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is None:
            return
        self.block_hash[b] = None
        ids = self._cached.get(h)
        if ids is not None and b in ids:
            ids.remove(b)
            if not ids:
                del self._cached[h]
            if self.enable_events:
                events = self._events
                if self.coalesce_removals and events and type(events[-1]) is BlockRemoved:
                    events[-1].block_hashes.append(self._external(h))  # the same index update as one event per block
                else:
                    events.append(BlockRemoved(block_hashes=[self._external(h)], medium=MEDIUM))

    def _cache_full_blocks(
        self, req_id: str, blocks: list[int], all_token_ids: Sequence[int], block_hashes: Sequence[bytes], num_full: int
    ) -> None:
        start = self._num_cached.get(req_id, 0)
        num_full = min(num_full, len(block_hashes), len(blocks))
        if num_full <= start:
            return
        external = self._external
        block_hash, cached = self.block_hash, self._cached
        for i in range(start, num_full):
            b = blocks[i]
            if block_hash[b] is None:
                h = block_hashes[i]
                block_hash[b] = h
                ids = cached.get(h)
                if ids is None:
                    cached[h] = [b]
                elif b not in ids:
                    ids.append(b)
        self._num_cached[req_id] = num_full
        if self.enable_events:
            bs = self.block_size
            keyed = block_hashes if type(block_hashes) is RequestHashes else None  # a LoRA or multimodal request
            self._events.append(
                BlockStored(
                    block_hashes=[external(h) for h in block_hashes[start:num_full]],
                    parent_block_hash=external(block_hashes[start - 1]) if start > 0 else None,
                    token_ids=list(all_token_ids[start * bs : num_full * bs]),
                    block_size=bs,
                    medium=MEDIUM,
                    lora_name=keyed.lora_name if keyed is not None else None,
                    mm_keys=keyed.mm_keys(start, num_full, bs) if keyed is not None else None,
                )
            )
