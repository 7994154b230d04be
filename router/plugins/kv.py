"""KV-aware cost scorer: cached-prefix overlap against predicted load (Dynamo's cost, exactly).

For a request of isl prompt tokens and each endpoint w with block size B:

    overlap(w)        = prompt blocks already cached on w, from the prefix index (router/kv_index.py)
    request_blocks    = ceil(isl / B)
    credit(w)         = (reuse_weight - 1) · overlap(w)·B
    pending(w)        = max(0, active_prefill_tokens(w) - credit(w))      (= active_prefill_tokens(w) at reuse 1)
    prefill_tokens(w) = isl - overlap(w)·B + pending(w)
    decode_blocks(w)  = (request_blocks - overlap(w)) + active_blocks(w)
    logit(w)          = overlap_weight · prefill_tokens(w) / B + decode_blocks(w)
                        + request_weight · inflight_requests(w)                          (lower is better)
    score(w)          = (max_logit - logit(w)) / (max_logit - min_logit)   in [0, 1];  all 1.0 when equal

Dynamo's cost is overlap_weight = 1, reuse_weight = 1, request_weight = 0, temperature = 0; the served defaults are
in router/config.py (KvPolicyConfig), and the weights are required here.
With reuse_weight 1 the prefill term trades a cached prompt token 1:1 against a token of other requests' pending
prefill: the choice that minimises this request's own TTFT. It ignores that a prefix recomputed elsewhere costs
the fleet that compute again (and a second copy of the blocks), which under load delays everyone after it;
reuse_weight > 1 counts each cached token that many pending ones, but only against the worker's pending prefill
(the credit stops at an empty prefill queue): it keeps a request with its cached prefix behind other prompts
without ever outweighing decode load, so a hot prefix with short prompts still spreads.
request_weight prices each request in flight on w at that many blocks of decode load on top of the blocks it holds:
a running sequence takes a batch slot whatever its length. Blocks alone let a long cached prefix with short
suffixes outweigh many concurrent requests (a 10-block hit at overlap weight 16 outweighs 15 requests of 11
blocks); with a per-request price the pile on the holder is bounded in requests too. Against long prompts (the
trace's hundreds of blocks each) it changes almost nothing.
The frontend passes `frontend.router.kv` (router/config.py); docs/benchmarks.md has the runs that chose the defaults.
active_prefill_tokens and active_blocks are the router's own bookkeeping (router/load.py: booked at
route time as the uncached prompt tokens and all prompt blocks, prefill released at the first
token, blocks at completion, on every path), so a worker is never invisible as loaded. The frontend
also drains the booked prefill at each worker's measured prefill rate (`kv_prefill_drain`, router/load.py):
active_prefill_tokens is then the estimated prefill left, not what was booked, so a worker near the end of
a long prompt reads as nearly free (Dynamo keeps the whole prompt booked until its first token).
Unlike Dynamo, active blocks are not deduplicated across requests sharing a prefix: each in-flight
request counts all the blocks it reads, which spreads a hot prefix over more workers sooner.

The score is an affine map of -logit, so with this scorer alone the max-score picker is Dynamo's
argmin (ties uniformly at random) and the softmax picker at temperature T samples
p(w) ∝ exp(-logit(w) / ((max - min)·T)), Dynamo's softmax. The policy `kv` is exactly that.
An endpoint whose block size differs from the one the prompt was hashed at gets overlap 0.
"""

from __future__ import annotations

from router._kernels import kv_scores, py_kv_logits
from router.types import Endpoint, RouteRequest

__all__ = ["KvCostScorer", "kv_logits"]


def kv_logits(request: RouteRequest, endpoints: list[Endpoint], overlap_weight: float, reuse_weight: float,
              request_weight: float) -> list[float]:
    """logit(w) per endpoint, in endpoint order (lower is better). For tests and explanations."""
    return py_kv_logits(endpoints, request.overlap_blocks, request.isl, request.hashed_block_size, overlap_weight, reuse_weight,
                        request_weight)


class KvCostScorer:
    name = "kv"

    def __init__(self, overlap_weight: float, reuse_weight: float, request_weight: float) -> None:
        self.overlap_weight = overlap_weight
        self.reuse_weight = reuse_weight
        self.request_weight = request_weight

    def score(self, request: RouteRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        # C kernel (or its Python twin in router/_kernels.py): kv_logits, then the normalisation above
        eps = endpoints if type(endpoints) is list else list(endpoints)
        return kv_scores(eps, request.overlap_blocks, request.isl, request.hashed_block_size, self.overlap_weight, self.reuse_weight,
                         self.request_weight)
