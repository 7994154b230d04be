"""The planner in the replay's loop: kvyard's PlannerLoop exactly as `kvyard up` builds it (planner/service.py),
on the replay's virtual clock.

    telemetry   the frontend's recorder (orchestrator/telemetry_recorder.py FrontendTelemetry): the replay calls
                on_arrival / on_finish where the service does; every telemetry_interval_s its flusher writes the
                aggregator's batch, with the pool's worker snapshot, into an in-memory TelemetryStore
    decisions   every planner interval_s: PlannerLoop.tick() (observe -> PlannerCore.on_tick -> act -> record)
    connector   ReplayConnector: get_replicas = starting + ready workers per pool; set_replicas = Replay.scale
                (new workers serve after the replay's startup_s, billed from the request; removed ones drain)

The YAML is `kvyard planner`'s ({planner: PlannerConfig fields, targets: Targets}); without targets, one pool
per role with the replay's SLO targets, 1..max_replicas replicas. The planner's perf model defaults to the
replay's engine profile.
"""

from __future__ import annotations

from orchestrator.replay.runner import Replay, run_sync
from orchestrator.telemetry_recorder import FrontendTelemetry
from planner.config import PlannerConfig
from planner.service import build_planner
from planner.telemetry.schema import PoolKey, TelemetrySchema
from planner.telemetry.store import InMemoryTelemetryStore
from planner.telemetry.targets import InMemoryTargetsStore, parse_targets

__all__ = ["PlannerDriver", "ReplayConnector", "default_targets"]


class ReplayConnector:
    """PlannerConnector on a Replay."""

    name = "replay"

    def __init__(self, replay: Replay) -> None:
        self.replay = replay
        self.log: list[tuple[float, dict[str, int]]] = []

    async def get_replicas(self) -> dict[PoolKey, int]:
        r = self.replay
        return {PoolKey(r.cfg.model, role): len(r.active(role)) for role in r.roles}

    async def set_replicas(self, targets: dict[PoolKey, int]) -> dict[PoolKey, int]:
        r = self.replay
        out = {}
        for pool, n in targets.items():
            if pool.model == r.cfg.model and pool.role in r.roles:
                out[pool] = r.scale(pool.role, n)
        self.log.append((r.clock.now, {str(k): v for k, v in out.items()}))
        return out

    async def close(self) -> None:
        return None


def default_targets(replay: Replay, max_replicas: int = 64) -> dict:
    cfg = replay.cfg
    return {"pools": [{"model": cfg.model, "role": role, "ttft_p90_ms": cfg.slo_ttft_p90_ms, "itl_p90_ms": cfg.slo_itl_p90_ms,
                       "min_replicas": 1, "max_replicas": max_replicas, "gpus_per_replica": cfg.engine.gpus_per_replica}
                      for role in replay.roles]}


class PlannerDriver:
    def __init__(self, replay: Replay, doc: dict) -> None:
        self.replay = replay
        clock = replay.clock
        data = dict(doc.get("planner") or {})
        data.setdefault("default_profile", replay.profile_name)
        self.cfg = PlannerConfig(**data)
        self.store = InMemoryTelemetryStore(TelemetrySchema(bucket_s=10), clock=clock)
        self.targets = InMemoryTargetsStore()
        run_sync(self.targets.put(parse_targets(doc.get("targets") or default_targets(replay)), actor="replay"))
        self.connector = ReplayConnector(replay)
        self.loop = build_planner(self.cfg, self.store, self.targets, self.connector)
        self.loop.clock = clock
        fe = replay.cfg.frontend
        self.telemetry = FrontendTelemetry(self.store, replay.snapshot, fe.telemetry.interval_s, clock=clock, wall_clock=clock)
        replay.telemetry = self.telemetry
        replay.on_tick.append((fe.telemetry.interval_s, self._flush))
        replay.on_tick.append((self.cfg.interval_s, self._tick))
        self.decisions: list[dict] = []

    def _flush(self) -> None:
        run_sync(self.telemetry.flusher.flush())

    def _tick(self) -> None:
        d = run_sync(self.loop.tick())
        if d.changed:
            self.decisions.append({"t": round(d.at, 3), "pools": [p.as_dict() for p in d.changed]})
