"""KV-aware request router: pure, synchronous scoring and picking over live endpoints."""

from router.interfaces import Picker, Scorer
from router.load import LoadTracker
from router.policies import Policy, build_policy, policy_names
from router.router import NoEndpointsError, Router
from router.types import Endpoint, EndpointLoad, RouteRequest, RoutingDecision

__all__ = [
    "Endpoint",
    "EndpointLoad",
    "LoadTracker",
    "NoEndpointsError",
    "Picker",
    "Policy",
    "RouteRequest",
    "Router",
    "RoutingDecision",
    "Scorer",
    "build_policy",
    "policy_names",
]
