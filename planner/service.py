"""Entry points for running the planner: `kvyard planner` (against Redis) and `kvyard up` (in-process).

    build_planner(cfg, telemetry, targets, connector)   -> PlannerLoop (loads the perf profiles)
    embedded_planner(cfg, connector, ...)                -> (PlannerLoop, telemetry, targets) on the
                                                            in-memory stores, for `kvyard up`
    run_planner(cfg, redis_url, connector, stop=...)     -> runs until `stop`; `kvyard planner`
Profiles: `cfg.profiles[model]` for a model, else `cfg.default_profile` (bundled name or directory).
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from planner.config import PlannerConfig
from planner.connectors.base import PlannerConnector
from planner.core import PlannerCore
from planner.loop import PlannerLoop
from planner.metrics import PlannerMetrics
from planner.perf_model import load_perf_model
from planner.telemetry.redis_store import RedisTelemetryStore
from planner.telemetry.schema import TelemetrySchema
from planner.telemetry.store import InMemoryTelemetryStore, TelemetryStore
from planner.telemetry.targets import InMemoryTargetsStore, RedisTargetsStore, TargetsStore

__all__ = ["build_planner", "embedded_planner", "run_planner"]

log = logging.getLogger("kvyard.planner")


def build_planner(cfg: PlannerConfig, telemetry: TelemetryStore, targets: TargetsStore, connector: PlannerConnector,
                  registry: CollectorRegistry | None = None) -> PlannerLoop:
    perf = {model: load_perf_model(path, cfg.max_num_seqs) for model, path in cfg.profiles.items()}
    default = load_perf_model(cfg.default_profile, cfg.max_num_seqs) if cfg.default_profile else None
    core = PlannerCore(cfg, perf, default)
    return PlannerLoop(core, telemetry, targets, connector, PlannerMetrics(registry))


def embedded_planner(cfg: PlannerConfig, connector: PlannerConnector, *, telemetry: TelemetryStore | None = None,
                     targets: TargetsStore | None = None, registry: CollectorRegistry | None = None,
                     ) -> tuple[PlannerLoop, TelemetryStore, TargetsStore]:
    """For `kvyard up`: in-memory stores shared with the in-process frontend (pass them in to share)."""
    telemetry = telemetry or InMemoryTelemetryStore()
    targets = targets or InMemoryTargetsStore()
    return build_planner(cfg, telemetry, targets, connector, registry), telemetry, targets


async def run_planner(cfg: PlannerConfig, redis_url: str, connector: PlannerConnector, *, prefix: str = "kvyard",
                      schema: TelemetrySchema | None = None, registry: CollectorRegistry | None = None,
                      stop: asyncio.Event | None = None) -> int:
    """`kvyard planner`: tick until `stop` is set; returns an exit code."""
    schema = schema or TelemetrySchema(prefix=prefix)
    telemetry = RedisTelemetryStore(redis_url, schema)
    targets = RedisTargetsStore(redis_url, prefix=prefix)
    loop = build_planner(cfg, telemetry, targets, connector, registry)
    log.info("planner: mode=%s predictor=%s interval=%.0fs connector=%s%s", cfg.mode, cfg.predictor, cfg.interval_s,
             connector.name, " (advisory)" if cfg.advisory else "")
    try:
        await loop.run(stop)
    finally:
        await connector.close()
        await telemetry.close()
        await targets.close()
    return 0
