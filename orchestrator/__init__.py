"""kvyard's frontend, CLI, configuration, local launcher and dashboard."""

from orchestrator.config import ClusterConfig, FrontendConfig
from orchestrator.errors import KvyardError

__all__ = ["ClusterConfig", "FrontendConfig", "KvyardError"]
