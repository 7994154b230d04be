"""PlannerConnector: how the planner loop reads and sets pool sizes. One Protocol, four implementations:

    virtual      records what it is told (tests, advisory dashboards, external actuators)
    local        WorkerSupervisors in this process's event loop (`kvyard up`)
    kubernetes   the pool Deployments' scale subresource (official client)
    ray          one Ray actor per worker on a Ray cluster (`kvyard up --ray`)
Registered by name in `planner.connectors.make_connector`; heavy clients are imported lazily.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from planner.telemetry.schema import PoolKey

__all__ = ["PlannerConnector", "ConnectorError"]


class ConnectorError(RuntimeError):
    """The connector could not read or apply replica counts (the loop logs it and retries next tick)."""


@runtime_checkable
class PlannerConnector(Protocol):
    name: str

    async def get_replicas(self) -> dict[PoolKey, int]:
        """Called at the start of every tick: current replicas per pool it manages, counting ones
        still starting and not counting ones draining. Raises ConnectorError."""
        ...

    async def set_replicas(self, targets: dict[PoolKey, int]) -> dict[PoolKey, int]:
        """Called with the pools whose count changes. Starts or drains workers without waiting for
        them to be ready / gone, and returns the counts now in effect for those pools (which may
        differ if some could not be applied). Scaling down drains first: no request is lost."""
        ...

    async def close(self) -> None: ...
