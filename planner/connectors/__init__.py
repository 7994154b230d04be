"""Planner connectors behind one Protocol (base.PlannerConnector); heavy ones import lazily."""

from planner.connectors.base import ConnectorError, PlannerConnector
from planner.connectors.local import LocalConnector
from planner.connectors.virtual import VirtualConnector

__all__ = ["PlannerConnector", "ConnectorError", "VirtualConnector", "LocalConnector", "connector_names", "connector_class"]

_CONNECTORS = {
    "virtual": "planner.connectors.virtual:VirtualConnector",
    "local": "planner.connectors.local:LocalConnector",
    "kubernetes": "planner.connectors.kubernetes:KubernetesConnector",
    "ray": "planner.connectors.ray:RayConnector",
}


def connector_names() -> list[str]:
    return sorted(_CONNECTORS)


def connector_class(name: str) -> type:
    """The connector class registered under `name` (imported on first use)."""
    import importlib

    if name not in _CONNECTORS:
        raise ConnectorError(f"unknown connector {name!r}; known: {', '.join(connector_names())}")
    module, _, attr = _CONNECTORS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
