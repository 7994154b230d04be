"""Least-loaded scorer.

    load(w)  = inflight_requests(w) + engine_waiting(w) + prefill_tokens(w) / block_size(w)
    score(w) = 1 - load(w) / max_w load(w)          (all equal -> 1.0 each)

In-flight counts come from the router's own bookkeeping (updated at route time, first token and
completion, so a worker is never invisible as loaded between metric scrapes); the engine's waiting
queue from its last scrape adds what other frontends sent there.
"""

from __future__ import annotations

from router.types import Endpoint, RouteRequest

__all__ = ["LoadScorer", "endpoint_load"]


def endpoint_load(ep: Endpoint) -> float:
    ld = ep.load
    return ld.inflight_requests + ld.engine_waiting + ld.prefill_tokens / max(ep.block_size, 1)


class LoadScorer:
    name = "load"

    def score(self, request: RouteRequest, endpoints: list[Endpoint]) -> dict[str, float]:
        loads = {ep.worker_id: endpoint_load(ep) for ep in endpoints}
        top = max(loads.values())
        if top <= 0:
            return {wid: 1.0 for wid in loads}
        return {wid: 1.0 - ld / top for wid, ld in loads.items()}
