"""One typed config tree, built at the entry point (orchestrator/cli.py) from YAML, environment and flags;
nothing below the entry point reads the environment.

    ClusterConfig (kvyard up)      engine settings, local workers, `frontend:`, `planner:`, `ray:`
    WorkerConfig  (kvyard worker)  engine settings, role, ports, registration
    FrontendConfig                 server, `router:`, `resilience:`, `admission:`, `security:`, `telemetry:`, `disagg:`

The whole reference, generated from the models: docs/configuration.md (`kvyard config reference`).
"""

from orchestrator.config.cluster import ClusterConfig, EngineSettings, LocalPlannerConfig, RayConfig, WorkerConfig
from orchestrator.config.frontend import (
    AdmissionConfig,
    DisaggConfig,
    FrontendConfig,
    FrontendFile,
    ResilienceConfig,
    SecurityConfig,
    TelemetryConfig,
)
from orchestrator.config.loading import ConfigFileError, Flag, load_yaml
from router.config import KvPolicyConfig, RouterConfig

__all__ = [
    "AdmissionConfig", "ClusterConfig", "ConfigFileError", "DisaggConfig", "EngineSettings", "Flag", "FrontendConfig", "FrontendFile",
    "KvPolicyConfig", "LocalPlannerConfig", "RayConfig", "ResilienceConfig", "RouterConfig", "SecurityConfig",
    "TelemetryConfig", "WorkerConfig", "load_yaml",
]
