"""Planner targets: per-pool SLA and bounds plus a GPU budget, validated, versioned, stored.

    PoolTarget   model, role, ttft_p90_ms, itl_p90_ms, tokens_per_s (each optional, > 0),
                 min_replicas >= 0, max_replicas >= max(1, min), gpus_per_replica >= 1
    Targets      pools (one per (model, role)), gpu_budget (None = unlimited) which must fit
                 every pool's min_replicas · gpus_per_replica
Each accepted change bumps `version` by one and is appended to a capped history.
`put(..., expected_version=v)` refuses with TargetsConflictError unless the current version is v.

Redis schema (prefix defaults to "kvyard"):
    {prefix}:targets            STRING  VersionedTargets as JSON (no expiry)
    {prefix}:targets:history    LIST    previous + current VersionedTargets JSON, newest first, capped
Writes are one Lua script (compare version, set, LPUSH, LTRIM), so concurrent writers cannot lose
an update.
"""

from __future__ import annotations

import json
import time
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from workers.types import WorkerRole

__all__ = [
    "PoolTarget", "Targets", "VersionedTargets", "TargetsStore", "InMemoryTargetsStore", "RedisTargetsStore",
    "TargetsError", "TargetsValidationError", "TargetsConflictError", "TargetsUnavailableError", "parse_targets",
]


class TargetsError(Exception):
    """Base of the targets errors."""


class TargetsValidationError(TargetsError):
    """Targets were refused; `.field` names the offending key (dotted path)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TargetsConflictError(TargetsError):
    """expected_version did not match the stored version."""


class TargetsUnavailableError(TargetsError):
    """The store could not be reached."""


class PoolTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    role: WorkerRole = WorkerRole.BOTH
    ttft_p90_ms: float | None = Field(None, gt=0, le=600_000)
    itl_p90_ms: float | None = Field(None, gt=0, le=60_000)
    tokens_per_s: float | None = Field(None, gt=0)
    min_replicas: int = Field(1, ge=0, le=10_000)
    max_replicas: int = Field(8, ge=1, le=10_000)
    gpus_per_replica: int = Field(1, ge=1, le=64)

    @model_validator(mode="after")
    def _bounds(self) -> PoolTarget:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        return self


class Targets(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pools: list[PoolTarget] = Field(default_factory=list)
    gpu_budget: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> Targets:
        seen = set()
        for p in self.pools:
            key = (p.model, p.role)
            if key in seen:
                raise ValueError(f"pool {p.model}/{p.role.value} is listed twice")
            seen.add(key)
        floor = sum(p.min_replicas * p.gpus_per_replica for p in self.pools)
        if self.gpu_budget is not None and floor > self.gpu_budget:
            raise ValueError(f"gpu_budget ({self.gpu_budget}) is below the GPUs the pools' min_replicas need ({floor})")
        return self

    def pool(self, model: str, role: str) -> PoolTarget | None:
        for p in self.pools:
            if p.model == model and p.role.value == role:
                return p
        return None


class VersionedTargets(BaseModel):
    version: int = Field(ge=1)
    updated_at: float
    updated_by: str = ""
    targets: Targets


def parse_targets(data: object) -> Targets:
    """Validate raw JSON-able data; raises TargetsValidationError naming the first bad field."""
    try:
        if isinstance(data, (str, bytes)):
            return Targets.model_validate_json(data)
        return Targets.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "invalid value")
        raise TargetsValidationError(f"invalid targets: {path + ': ' if path else ''}{msg}", field=path or None) from exc


@runtime_checkable
class TargetsStore(Protocol):
    async def get(self) -> VersionedTargets | None:
        """The current targets, or None if never set. Called by the planner each tick."""
        ...

    async def put(self, targets: Targets, *, expected_version: int | None = None, actor: str = "") -> VersionedTargets:
        """Store a new version (current + 1). Raises TargetsConflictError if expected_version is given
        and differs from the current version (0 = expect none yet)."""
        ...

    async def history(self, limit: int = 20) -> list[VersionedTargets]:
        """Newest first."""
        ...

    async def close(self) -> None: ...


class InMemoryTargetsStore:
    def __init__(self, history_cap: int = 100) -> None:
        self.history_cap = history_cap
        self._history: list[VersionedTargets] = []

    async def get(self) -> VersionedTargets | None:
        return self._history[0] if self._history else None

    async def put(self, targets: Targets, *, expected_version: int | None = None, actor: str = "") -> VersionedTargets:
        current = self._history[0].version if self._history else 0
        if expected_version is not None and expected_version != current:
            raise TargetsConflictError(f"targets are at version {current}, not {expected_version}")
        vt = VersionedTargets(version=current + 1, updated_at=time.time(), updated_by=actor, targets=targets)
        self._history.insert(0, vt)
        del self._history[self.history_cap:]
        return vt

    async def history(self, limit: int = 20) -> list[VersionedTargets]:
        return list(self._history[:limit])

    async def close(self) -> None:
        return None


_PUT_LUA = """
local cur = redis.call('GET', KEYS[1])
local ver = 0
if cur then ver = tonumber(cjson.decode(cur)['version']) end
local expected = tonumber(ARGV[1])
if expected >= 0 and expected ~= ver then return {0, ver} end
local out = '{"version": ' .. (ver + 1) .. ', ' .. ARGV[2]
redis.call('SET', KEYS[1], out)
redis.call('LPUSH', KEYS[2], out)
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[3]) - 1)
return {1, ver + 1}
"""


class RedisTargetsStore:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "kvyard", *, client=None,
                 history_cap: int = 100, timeout_s: float = 2.0) -> None:
        from workers.redis_conn import redis_client

        self._redis = client or redis_client(url, timeout_s)
        self.key = f"{prefix}:targets"
        self.history_key = f"{prefix}:targets:history"
        self.history_cap = history_cap
        self._put = self._redis.register_script(_PUT_LUA)

    async def _run(self, coro):
        import redis.exceptions

        try:
            return await coro
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            raise TargetsUnavailableError(f"redis unavailable: {exc}") from exc

    async def get(self) -> VersionedTargets | None:
        raw = await self._run(self._redis.get(self.key))
        return VersionedTargets.model_validate_json(raw) if raw else None

    async def put(self, targets: Targets, *, expected_version: int | None = None, actor: str = "") -> VersionedTargets:
        now = time.time()
        doc = {"updated_at": now, "updated_by": actor, "targets": targets.model_dump(mode="json")}
        rest = json.dumps(doc)[1:]  # the script prepends '{"version": N, '
        expected = -1 if expected_version is None else expected_version
        ok, ver = await self._run(self._put(keys=[self.key, self.history_key], args=[expected, rest, self.history_cap]))
        if not ok:
            raise TargetsConflictError(f"targets are at version {ver}, not {expected_version}")
        return VersionedTargets(version=int(ver), updated_at=now, updated_by=actor, targets=targets)

    async def history(self, limit: int = 20) -> list[VersionedTargets]:
        raws = await self._run(self._redis.lrange(self.history_key, 0, max(limit, 1) - 1))
        return [VersionedTargets.model_validate_json(r) for r in raws]

    async def close(self) -> None:
        await self._redis.aclose()
