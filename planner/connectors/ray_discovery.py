"""Worker discovery held by a Ray actor, for `kvyard up --ray` without Redis.

The frontend (in the driver) and the worker actors (anywhere on the Ray cluster) are different
processes, so `InMemoryDiscovery` cannot be shared directly. `DiscoveryHub` is an async Ray actor
that owns one `InMemoryDiscovery` (leases and all); `RayActorDiscovery` implements the `Discovery`
protocol by forwarding every call to it. It holds only the actor handle, so it pickles into the
worker actors' specs. Hub unreachable (actor dead, cluster gone) -> `DiscoveryError`, as for Redis.

    hub = start_discovery_hub(name="kvyard-ab12cd:discovery")   # in the driver (needs ray.init)
    discovery = RayActorDiscovery(hub)                           # driver and workers alike
"""

from __future__ import annotations

from workers.discovery import FAILURE_TTL_S, DiscoveryError, InMemoryDiscovery
from workers.types import WorkerFailure, WorkerInfo, WorkerState

__all__ = ["DiscoveryHub", "RayActorDiscovery", "start_discovery_hub", "RAY_NAMESPACE"]

RAY_NAMESPACE = "kvyard"  # named actors of kvyard (workers and hubs) live here: `ray list actors` shows them


class DiscoveryHub:
    """The actor body (wrapped with ray.remote in `start_discovery_hub`): an InMemoryDiscovery."""

    def __init__(self) -> None:
        self.d = InMemoryDiscovery()

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        await self.d.register(info, ttl_s)

    async def renew(self, worker_id: str, ttl_s: float) -> bool:
        return await self.d.renew(worker_id, ttl_s)

    async def set_state(self, worker_id: str, state: WorkerState) -> None:
        await self.d.set_state(worker_id, state)

    async def deregister(self, worker_id: str) -> None:
        await self.d.deregister(worker_id)

    async def list_workers(self) -> list[WorkerInfo]:
        return await self.d.list_workers()

    async def publish_files(self, model: str, files: dict[str, bytes]) -> None:
        await self.d.publish_files(model, files)

    async def fetch_files(self, model: str) -> dict[str, bytes]:
        return await self.d.fetch_files(model)

    async def report_failure(self, failure: WorkerFailure, ttl_s: float) -> None:
        await self.d.report_failure(failure, ttl_s)

    async def list_failures(self) -> list[WorkerFailure]:
        return await self.d.list_failures()


def start_discovery_hub(name: str, namespace: str = RAY_NAMESPACE):
    """Create the hub actor (no CPU reserved: it only answers small calls). Lives as long as the
    driver that created it, or until `ray.kill`."""
    import ray

    return ray.remote(DiscoveryHub).options(name=name, namespace=namespace, num_cpus=0, max_concurrency=1000).remote()


class RayActorDiscovery:
    """`Discovery` over a `DiscoveryHub` actor handle."""

    def __init__(self, hub) -> None:
        self.hub = hub

    async def _call(self, method: str, *args):
        from ray.exceptions import RayError

        try:
            return await getattr(self.hub, method).remote(*args)
        except RayError as exc:
            raise DiscoveryError(f"discovery hub unavailable: {type(exc).__name__}: {exc}") from exc

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        await self._call("register", info, ttl_s)

    async def renew(self, worker_id: str, ttl_s: float) -> bool:
        return bool(await self._call("renew", worker_id, ttl_s))

    async def set_state(self, worker_id: str, state: WorkerState) -> None:
        await self._call("set_state", worker_id, state)

    async def deregister(self, worker_id: str) -> None:
        await self._call("deregister", worker_id)

    async def list_workers(self) -> list[WorkerInfo]:
        return list(await self._call("list_workers"))

    async def publish_files(self, model: str, files: dict[str, bytes]) -> None:
        await self._call("publish_files", model, files)

    async def fetch_files(self, model: str) -> dict[str, bytes]:
        return dict(await self._call("fetch_files", model))

    async def report_failure(self, failure: WorkerFailure, ttl_s: float = FAILURE_TTL_S) -> None:
        await self._call("report_failure", failure, ttl_s)

    async def list_failures(self) -> list[WorkerFailure]:
        return list(await self._call("list_failures"))

    async def close(self) -> None:
        return None  # the hub belongs to whoever started it
