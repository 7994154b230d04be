"""The fleet bound on prefix-cache hits: what no router over these engines can beat on this workload.

One pooled cache of the fleet's total capacity (workers × (num_gpu_blocks − 1) blocks) run with Belady's optimal
offline eviction (evict the block needed farthest in the future) over the engine blocks of every prompt in
arrival order, every computed block cached (demand paging), every cached block counted as a hit wherever it sits
in the prompt, each request's hits capped as the engines cap them ((isl − 1) // B blocks: the last prompt token
is always computed). Per-worker caches of C blocks are one policy of a pooled cache of workers × C, and routing,
pinning running requests' blocks, counting only a cached prefix and prefill time can each only lower the hits:
the same bound as benchmarks/routing.py's fleet_bound_hits, on the trace's block structure. The infinite-cache
oracle (every block any earlier prompt had) is reported beside it.

Engine block j of a prompt is named by (the chain of trace hash ids up to its trace block, j's place in that
block), which is exactly when two prompts share the block's tokens and prefix (workload.py's token layout).
Needs the engine block size to divide the trace block (else None is returned).
"""

from __future__ import annotations

import heapq

import numpy as np

from orchestrator.replay.workload import Workload

__all__ = ["fleet_bound"]


def _keys(workload: Workload, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat block keys in access order, blocks per request, hit cap per request in blocks)."""
    sub = workload.trace_block // block_size
    sub_range = np.arange(sub, dtype=np.uint64)
    per: list[np.ndarray] = []
    counts = np.zeros(len(workload), dtype=np.int64)
    caps = np.zeros(len(workload), dtype=np.int64)
    chain_of: dict[tuple[int, int], int] = {}
    for i, r in enumerate(workload.requests):
        n = r.input_length // block_size
        caps[i] = (r.input_length - 1) // block_size
        need = -(-n // sub) if n else 0
        cids = np.empty(need, dtype=np.uint64)
        prev = 0
        for k in range(need):
            h = r.hash_ids[k] if k < len(r.hash_ids) else -(i + 1) * 1_000_003 - k  # missing ids: own content
            key = (prev, h)
            c = chain_of.get(key)
            if c is None:
                c = chain_of[key] = len(chain_of) + 1
            cids[k] = c
            prev = c
        keys = (np.repeat(cids, sub) * np.uint64(sub) + np.tile(sub_range, need))[:n]
        per.append(keys)
        counts[i] = n
    flat = np.concatenate(per) if per else np.zeros(0, dtype=np.uint64)
    return flat, counts, caps


def _next_use(flat: np.ndarray) -> np.ndarray:
    n = len(flat)
    order = np.argsort(flat, kind="stable")
    nxt = np.full(n, n + 1, dtype=np.int64)
    same = flat[order[1:]] == flat[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def fleet_bound(workload: Workload, block_size: int, capacity_blocks: int) -> dict | None:
    """Hit rates (prompt tokens) of the pooled Belady cache and of the infinite oracle; None when the engine block
    size does not divide the trace block."""
    if block_size <= 0 or workload.trace_block % block_size or capacity_blocks < 1:
        return None
    flat, counts, caps = _keys(workload, block_size)
    nxt = _next_use(flat).tolist()
    keys = flat.tolist()
    cache: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries are skipped
    push, pop = heapq.heappush, heapq.heappop
    seen: set[int] = set()
    hits = oracle = queries = 0
    pos = 0
    for i, n in enumerate(counts.tolist()):
        present = known = 0
        for _ in range(n):
            key, nu = keys[pos], nxt[pos]
            pos += 1
            if key in seen:
                known += 1
            else:
                seen.add(key)
            if key in cache:
                present += 1
                cache[key] = nu
                push(heap, (-nu, key))
                continue
            while len(cache) >= capacity_blocks:
                far, victim = heap[0]
                if cache.get(victim) != -far:
                    pop(heap)
                    continue
                pop(heap)
                del cache[victim]
            cache[key] = nu  # demand paging: every computed block enters the cache
            push(heap, (-nu, key))
        cap = int(caps[i])
        hits += min(present, cap) * block_size
        oracle += min(known, cap) * block_size
        queries += workload.requests[i].input_length
    return {"capacity_blocks": capacity_blocks, "block_size": block_size, "queries": queries,
            "hits": hits, "hit_rate": hits / queries if queries else None,
            "oracle_hits": oracle, "oracle_hit_rate": oracle / queries if queries else None}
