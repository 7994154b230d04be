"""What the planner state machine takes in and gives out (plain data, no I/O)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from planner.telemetry.schema import PoolKey, PoolStats
from planner.telemetry.targets import VersionedTargets

__all__ = ["PoolObservation", "Observation", "PoolDecision", "Decision", "Demand"]


@dataclass(slots=True)
class PoolObservation:
    """One pool as the loop saw it: telemetry over the window and the replicas the connector reports."""

    pool: PoolKey
    replicas: int  # as the connector reports them (ready + starting)
    stats: PoolStats | None = None  # None: no telemetry for this pool in the window
    data_age_s: float | None = None  # now − end of the newest bucket with data
    worker_queue: list[float] = field(default_factory=list)  # waiting requests per worker, latest
    worker_kv: list[float] = field(default_factory=list)  # KV usage per worker, latest


@dataclass(slots=True)
class Observation:
    targets: VersionedTargets | None
    pools: dict[PoolKey, PoolObservation]
    telemetry_ok: bool = True  # False: the store was unreachable this tick
    note: str = ""


@dataclass(slots=True)
class Demand:
    """The load a pool is sized for: predicted from the observed window."""

    request_rate: float  # requests/s
    isl: float
    osl: float
    kv_hit_rate: float
    isl_cv2: float = 1.0  # spread of prompt lengths (1.0: as variable as an exponential)

    def as_dict(self) -> dict:
        return {k: round(v, 4) for k, v in asdict(self).items()}


@dataclass(slots=True)
class PoolDecision:
    pool: PoolKey
    current: int
    desired: int
    reason: str  # human-readable, always set
    demand: Demand | None = None
    sla_replicas: int | None = None  # before guardrails
    held: bool = False  # True when the pool was deliberately left as is (stale telemetry, cooldown...)

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def as_dict(self) -> dict:
        return {"model": self.pool.model, "role": self.pool.role, "current": self.current, "desired": self.desired,
                "changed": self.changed, "held": self.held, "reason": self.reason, "sla_replicas": self.sla_replicas,
                "demand": self.demand.as_dict() if self.demand else None}


@dataclass(slots=True)
class Decision:
    tick: int
    at: float
    pools: list[PoolDecision]
    advisory: bool = False
    targets_version: int | None = None
    reason: str = ""

    @property
    def changed(self) -> list[PoolDecision]:
        return [p for p in self.pools if p.changed]

    def replica_targets(self) -> dict[PoolKey, int]:
        """What a connector should apply: the desired count of every pool that changes."""
        return {p.pool: p.desired for p in self.pools if p.changed}

    def as_dict(self) -> dict:
        return {"tick": self.tick, "at": self.at, "advisory": self.advisory, "targets_version": self.targets_version,
                "reason": self.reason, "pools": [p.as_dict() for p in self.pools]}
