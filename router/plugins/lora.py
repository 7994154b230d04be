"""LoRA adapter affinity: a request for an adapter goes to a worker that already holds it. A router stage.

    holders(request)  = candidates whose `adapters` (set by the frontend from what it loaded) contain
                        request.lora_name
    rerank(request)   = the holders that are not overloaded, in the policy's order, then everyone else in the
                        policy's order (base-model requests and requests no worker holds the adapter of: unchanged)
    overloaded(w)     = load(w) - min over candidates of load(w') > max_load_gap
    load(w)           = requests in flight on w + requests waiting in w's engine (router/plugins/affinity.py)

A holder serves at once; any other worker must load the adapter first (hundreds of ms on a GPU, and a slot of its
adapter cache). The block hashes already carry the adapter (router/hashing.py seeds them with its name, as the
engine's keys carry it), so among the holders the KV cost still prefers the one with the adapter's prefix cached.
Default max_load_gap: 4 requests. Pure and synchronous.
"""

from __future__ import annotations

from router.plugins.affinity import request_load
from router.types import Endpoint, RouteRequest

__all__ = ["AdapterAffinity"]


class AdapterAffinity:
    name = "lora-affinity"

    def __init__(self, max_load_gap: float = 4.0) -> None:
        if max_load_gap < 0:
            raise ValueError("max_load_gap must be >= 0")
        self.max_load_gap = max_load_gap

    def rerank(self, request: RouteRequest, ranked: list[Endpoint]) -> list[Endpoint]:
        name = request.lora_name
        if not name:
            return ranked
        floor = min(request_load(ep) for ep in ranked)
        first = [ep for ep in ranked if name in ep.adapters and request_load(ep) - floor <= self.max_load_gap]
        if not first:
            return ranked
        chosen = {id(ep) for ep in first}
        return first + [ep for ep in ranked if id(ep) not in chosen]

    def on_booked(self, request: RouteRequest, endpoint: Endpoint) -> None:
        return None  # residency is the frontend's to track (it loads the adapters)

    def remove_worker(self, worker_id: str) -> None:
        return None
