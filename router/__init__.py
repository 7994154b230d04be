"""KV-aware request router: pure, synchronous scoring and picking over live endpoints.

The I/O edge that feeds the prefix index from engines' KV events is router.events.KvEventIngestor
(imported from there: it pulls in pyzmq and httpx).
"""

from router.errors import BlockHashError, KvEventRejected, RouterError
from router.hashing import block_hashes
from router.interfaces import Picker, Scorer, Stage
from router.kv_index import KvIndex
from router.load import LoadTracker
from router.policies import Policy, build_policy, policy_names
from router.router import NoEndpointsError, Router
from router.types import Endpoint, EndpointLoad, RouteRequest, RoutingDecision

__all__ = [
    "BlockHashError",
    "Endpoint",
    "EndpointLoad",
    "KvEventRejected",
    "KvIndex",
    "LoadTracker",
    "NoEndpointsError",
    "Picker",
    "Policy",
    "RouteRequest",
    "Router",
    "RouterError",
    "RoutingDecision",
    "Scorer",
    "Stage",
    "block_hashes",
    "build_policy",
    "policy_names",
]
