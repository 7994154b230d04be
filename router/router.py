"""Router: the one entry point the frontend calls per request.

route() = score (weighted, clamped) -> pick (ranking) -> book the load on the best endpoint.
The frontend reports back with on_first_token() and on_complete() on every path (success, error,
cancel, failover), which keeps the predicted load honest. Pure and synchronous.
"""

from __future__ import annotations

import time

from router.load import LoadTracker
from router.policies import Policy, build_policy
from router.types import Endpoint, RouteRequest, RoutingDecision

__all__ = ["Router", "NoEndpointsError"]


class NoEndpointsError(LookupError):
    """No live endpoint can serve the request's model."""


class Router:
    def __init__(self, policy: Policy | str = "round-robin", load: LoadTracker | None = None) -> None:
        self.policy = build_policy(policy) if isinstance(policy, str) else policy
        self.loads = load or LoadTracker()
        self.last_decision_s = 0.0

    def route(self, request: RouteRequest, endpoints: list[Endpoint]) -> RoutingDecision:
        if not endpoints:
            raise NoEndpointsError(f"no live worker serves model {request.model!r}")
        t0 = time.perf_counter()
        for ep in endpoints:
            ep.load = self._merged_load(ep)
        scores = self._score(request, endpoints)
        ranked = self.policy.picker.rank(scores, endpoints)
        decision = RoutingDecision(ranked=ranked, scores=scores, policy=self.policy.name)
        self.book(request, decision.best)
        self.last_decision_s = time.perf_counter() - t0
        return decision

    def book(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """Record that `request` now runs on `endpoint` (also used on failover to the next-ranked one)."""
        self.loads.on_routed(request.request_id, endpoint.worker_id, request.isl, endpoint.block_size)

    def on_first_token(self, request_id: str) -> None:
        self.loads.on_first_token(request_id)

    def on_complete(self, request_id: str) -> None:
        self.loads.on_complete(request_id)

    def remove_worker(self, worker_id: str) -> None:
        self.loads.remove_worker(worker_id)

    def _merged_load(self, ep: Endpoint):
        own = self.loads.load(ep.worker_id)
        own.engine_waiting = ep.load.engine_waiting
        own.engine_kv_usage = ep.load.engine_kv_usage
        return own

    def _score(self, request: RouteRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        total = {ep.worker_id: 0.0 for ep in endpoints}
        for scorer, weight in self.policy.scorers:
            for wid, s in scorer.score(request, endpoints).items():
                if wid in total:
                    total[wid] += weight * min(1.0, max(0.0, s))
        return total
