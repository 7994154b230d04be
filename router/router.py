"""Router: the one entry point the frontend calls per request.

route() = merge loads -> match the prompt prefix (policies with a KV index) -> score (weighted,
clamped) -> pick (ranking) -> stages (router/interfaces.py: session affinity, LoRA adapter holders; each may move
endpoints forward) -> book the load on the best endpoint. The kv policy with its argmax picker (the
default) scores and ranks in one C pass (router/_kernels.py, kv_rank), with the same result.

The prefix step hashes the prompt once (router/hashing.py, at the block size of the first
endpoint; a model's workers share one) into `request.block_hashes` (a uint64 memoryview: a
read-only sequence of ints, with no int object per block) and looks it up in the
policy's index into `request.overlap_blocks`, which scorers read. A prompt with images or audio
(`request.mm_items`) is hashed with their keys mixed in (router/mm_hashing.py). Booking charges the endpoint
with the prompt tokens not cached there and, for workers without KV events, records the blocks
as predicted cache contents. The frontend reports back with on_first_token() and on_complete()
on every path (success, error, cancel, failover), which keeps the predicted load honest.
Pure and synchronous.
"""

from __future__ import annotations

import time

from router import _kernels
from router.hashing import block_hashes_view
from router.interfaces import Stage
from router.kv_index import KvIndex
from router.load import LoadTracker
from router.mm_hashing import mm_block_hashes_view
from router.plugins.kv import KvCostScorer
from router.plugins.pickers import MaxScorePicker
from router.policies import Policy, build_policy
from router.types import Endpoint, RouteRequest, RoutingDecision

__all__ = ["Router", "NoEndpointsError"]


class NoEndpointsError(LookupError):
    """No live endpoint can serve the request's model."""


class Router:
    def __init__(self, policy: Policy | str = "round-robin", load: LoadTracker | None = None, stages: list[Stage] | tuple = ()) -> None:
        self.policy = build_policy(policy) if isinstance(policy, str) else policy
        self.loads = load or LoadTracker()
        self.stages: list[Stage] = list(stages)
        self.last_decision_s = 0.0

    @property
    def kv_index(self) -> KvIndex | None:
        """The prefix index the policy routes on (feed it with router.events.KvEventIngestor)."""
        return self.policy.index

    def route(self, request: RouteRequest, endpoints: list[Endpoint]) -> RoutingDecision:
        if not endpoints:
            raise NoEndpointsError(f"no live worker serves model {request.model!r}")
        t0 = time.perf_counter()
        if self.loads.drain:
            self.loads.advance()
        self._merge_loads(endpoints)
        if self.policy.index is not None:
            self._match_prefix(request, endpoints[0].block_size)
        policy = self.policy
        picker, scorers = policy.picker, policy.scorers
        if type(picker) is MaxScorePicker and len(scorers) == 1 and type(scorers[0][0]) is KvCostScorer and scorers[0][1] == 1.0:
            # the kv policy with its argmax picker: score and rank in one pass (router/_kernels.py, kv_rank), the same
            # ranking as scorer.score then picker.rank, with the same draw from the picker's generator
            s = scorers[0][0]
            eps = endpoints if type(endpoints) is list else list(endpoints)
            ranked, packed = _kernels.kv_rank(eps, request.overlap_blocks, request.isl, request.hashed_block_size, s.overlap_weight,
                                              s.reuse_weight, s.request_weight, picker.draw())
            decision = RoutingDecision(ranked, None, policy.name, request.overlap_blocks, (eps, packed))
        else:
            scores = self._score(request, endpoints)
            ranked = picker.rank(scores, endpoints)
            decision = RoutingDecision(ranked, scores, policy.name, request.overlap_blocks)
        for stage in self.stages:
            ranked = decision.ranked = stage.rerank(request, ranked)
        self.book(request, ranked[0])
        self.last_decision_s = time.perf_counter() - t0
        return decision

    def book(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """Record that `request` now runs on `endpoint` (also used on failover to the next-ranked one)."""
        wid = endpoint.worker_id
        bs = endpoint.block_size
        cached = request.overlap_blocks.get(wid, 0) * bs if bs == request.hashed_block_size else 0
        self.loads.on_routed(request.request_id, wid, request.isl, bs, cached_tokens=cached)
        index = self.policy.index
        if index is not None and request.block_hashes and bs == request.hashed_block_size:
            index.record_routed(wid, request.block_hashes, cached=cached // bs)
        for stage in self.stages:
            stage.on_booked(request, endpoint)

    def prefix_cached(self, token_ids: list[int], block_size: int, lora_name: str | None = None) -> bool:
        """Whether every full block of `token_ids` (a prompt's first tokens) is cached or pending on some worker: only
        then can more of the prompt match (the frontend tokenizes a long prompt only that far, orchestrator/prepare.py).
        True with no full block yet (nothing tells)."""
        index = self.policy.index
        if index is None:
            return True
        hashes = block_hashes_view(token_ids, block_size, lora_name)
        if not len(hashes):
            return True
        matches = index.find_matches(hashes)
        return bool(matches) and max(matches.values()) >= len(hashes)

    def on_first_token(self, request_id: str) -> None:
        self.loads.on_first_token(request_id)

    def on_complete(self, request_id: str) -> None:
        self.loads.on_complete(request_id)

    def remove_worker(self, worker_id: str) -> None:
        self.loads.remove_worker(worker_id)
        for stage in self.stages:
            stage.remove_worker(worker_id)
        if self.policy.index is not None:
            self.policy.index.remove_worker(worker_id)

    def _merge_loads(self, endpoints: list[Endpoint]) -> None:
        """Each endpoint's load = the router's own bookkeeping + the engine fields of its last scrape."""
        _kernels.merge_loads(endpoints if type(endpoints) is list else list(endpoints), self.loads.booked())

    def _match_prefix(self, request: RouteRequest, block_size: int) -> None:
        if request.block_hashes is None or request.hashed_block_size != block_size:
            if request.mm_items:
                request.block_hashes = mm_block_hashes_view(request.token_ids, block_size, request.lora_name, request.mm_items)
            else:
                request.block_hashes = block_hashes_view(request.token_ids, block_size, request.lora_name)
            request.hashed_block_size = block_size
        request.overlap_blocks = self.policy.index.find_matches(request.block_hashes)

    def _score(self, request: RouteRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        scorers = self.policy.scorers
        if len(scorers) == 1:  # the common case: one scorer with weight 1 whose scores need no clamping
            scorer, weight = scorers[0]
            raw = scorer.score(request, endpoints)
            vals = raw.values()
            if weight == 1.0 and len(raw) == len(endpoints) and min(vals) >= 0.0 and max(vals) <= 1.0:
                return raw
            results = [(raw, weight)]
        else:
            results = [(scorer.score(request, endpoints), weight) for scorer, weight in scorers]
        total = {ep.worker_id: 0.0 for ep in endpoints}
        for raw, weight in results:
            for wid, s in raw.items():
                if wid in total:
                    total[wid] += weight * min(1.0, max(0.0, s))
        return total
