"""KV-aware cost scorer: cached-prefix overlap against predicted load (Dynamo's cost, exactly).

For a request of isl prompt tokens and each endpoint w with block size B:

    overlap(w)        = prompt blocks already cached on w, from the prefix index (router/kv_index.py)
    request_blocks    = ceil(isl / B)
    prefill_tokens(w) = isl - overlap(w)·B + active_prefill_tokens(w)
    decode_blocks(w)  = (request_blocks - overlap(w)) + active_blocks(w)
    logit(w)          = overlap_weight · prefill_tokens(w) / B + decode_blocks(w)      (lower is better)
    score(w)          = (max_logit - logit(w)) / (max_logit - min_logit)   in [0, 1];  all 1.0 when equal

Defaults here (as Dynamo, reference/dynamo.md §2.4): overlap_weight = 1.0, temperature = 0. The frontend
passes its own `kv_overlap_weight`, 4 by default (orchestrator/config.py; the sweep behind that choice is in
benchmarks/results/routing_sweep.md).
active_prefill_tokens and active_blocks are the router's own bookkeeping (router/load.py: booked at
route time as the uncached prompt tokens and all prompt blocks, prefill released at the first
token, blocks at completion, on every path), so a worker is never invisible as loaded.
Unlike Dynamo, active blocks are not deduplicated across requests sharing a prefix: each in-flight
request counts all the blocks it reads, which spreads a hot prefix over more workers sooner.

The score is an affine map of -logit, so with this scorer alone the max-score picker is Dynamo's
argmin (ties uniformly at random) and the softmax picker at temperature T samples
p(w) ∝ exp(-logit(w) / ((max - min)·T)), Dynamo's softmax. The policy `kv` is exactly that.
An endpoint whose block size differs from the one the prompt was hashed at gets overlap 0.
"""

from __future__ import annotations

from router._kernels import kv_scores
from router.types import Endpoint, RouteRequest

__all__ = ["KvCostScorer", "kv_logits"]


def kv_logits(request: RouteRequest, endpoints: list[Endpoint], overlap_weight: float = 1.0) -> list[float]:
    """logit(w) per endpoint, in endpoint order (lower is better). For tests and explanations."""
    isl = request.isl
    overlaps = request.overlap_blocks
    hashed = request.hashed_block_size
    out = []
    for ep in endpoints:
        bs = ep.block_size
        ov = overlaps.get(ep.worker_id, 0) if bs == hashed else 0
        ld = ep.load
        out.append(overlap_weight * (isl - ov * bs + ld.prefill_tokens) / bs + (-(-isl // bs) - ov + ld.active_blocks))
    return out


class KvCostScorer:
    name = "kv"

    def __init__(self, overlap_weight: float = 1.0) -> None:
        self.overlap_weight = overlap_weight

    def score(self, request: RouteRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        # C kernel (or its Python twin in router/_kernels.py): kv_logits, then the normalisation above
        eps = endpoints if type(endpoints) is list else list(endpoints)
        return kv_scores(eps, request.overlap_blocks, request.isl, request.hashed_block_size, self.overlap_weight)
