"""VirtualConnector: applies counts to an in-memory table and keeps a log of every call.
Used by tests, by advisory runs and by the offline benchmark (which reads the log)."""

from __future__ import annotations

import time
from collections.abc import Callable

from planner.telemetry.schema import PoolKey

__all__ = ["VirtualConnector"]


class VirtualConnector:
    name = "virtual"

    def __init__(self, initial: dict[PoolKey, int] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.replicas: dict[PoolKey, int] = dict(initial or {})
        self.log: list[tuple[float, dict[PoolKey, int]]] = []
        self.clock = clock

    async def get_replicas(self) -> dict[PoolKey, int]:
        return dict(self.replicas)

    async def set_replicas(self, targets: dict[PoolKey, int]) -> dict[PoolKey, int]:
        self.log.append((self.clock(), dict(targets)))
        self.replicas.update(targets)
        return dict(targets)

    async def close(self) -> None:
        return None
