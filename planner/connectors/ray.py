"""RayConnector: one Ray actor per worker; each actor runs a WorkerSupervisor (engine child process,
registered in Redis discovery, drained on stop). Used by `kvyard up --ray` on a Ray cluster.

Scale up: a new `KvyardWorkerActor` (num_cpus=actor_cpus, num_gpus=gpus_per_replica) is created
and `start()`ed in the background; it counts at once. Scale down: the newest actors are retired:
`stop()` drains the worker (state=draining, in-flight requests finish, deregister, engine stopped),
then the actor is killed. An actor whose start fails or that dies drops out of the count.
`spec_for(pool, ordinal)` returns the picklable `WorkerSpec` of a new worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.connectors.base import ConnectorError
from workers.telemetry.schema import PoolKey
from workers.types import EngineLaunchConfig

__all__ = ["RayConnector", "WorkerSpec", "KvyardWorkerActor"]

log = logging.getLogger("kvyard.planner.ray")


@dataclass
class WorkerSpec:
    backend: str
    engine: EngineLaunchConfig
    role: str
    redis_url: str
    discovery_prefix: str = "kvyard"
    worker_id: str | None = None
    lease_ttl_s: float = 6.0
    drain_timeout_s: float = 60.0
    tokenizer: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


class KvyardWorkerActor:
    """The actor body (wrapped with ray.remote by the connector, so importing this needs no Ray)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.sup = None
        self.task: asyncio.Task | None = None

    async def start(self) -> str:
        from workers.discovery import RedisDiscovery
        from workers.registry import get_backend
        from workers.types import WorkerRole
        from workers.worker import WorkerOptions, WorkerSupervisor

        s = self.spec
        opts = WorkerOptions(role=WorkerRole(s.role), lease_ttl_s=s.lease_ttl_s, drain_timeout_s=s.drain_timeout_s,
                             worker_id=s.worker_id, tokenizer=s.tokenizer, labels=dict(s.labels))
        self.sup = WorkerSupervisor(get_backend(s.backend), s.engine, RedisDiscovery(s.redis_url, s.discovery_prefix), opts)
        try:
            await self.sup.start()
        except BaseException:
            await self.sup.shutdown(drain=False)
            raise
        self.task = asyncio.create_task(self.sup.run())
        return self.sup.worker_id

    async def stop(self) -> int:
        if self.sup is None:
            return 0
        if self.task is None:
            await self.sup.shutdown(drain=False)
            return 0
        self.sup.request_stop()
        return await self.task

    async def alive(self) -> bool:
        return self.task is not None and not self.task.done()


@dataclass(eq=False)
class _Actor:
    pool: PoolKey
    handle: object
    started: asyncio.Task
    retiring: bool = False


class RayConnector:
    name = "ray"

    def __init__(self, spec_for: Callable[[PoolKey, int], WorkerSpec], *, actor_cpus: float = 0.5,
                 gpus_per_replica: dict[PoolKey, float] | None = None, ray_address: str | None = None,
                 init_kwargs: dict | None = None) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ConnectorError("the ray connector needs ray: pip install 'kvyard[planner]'") from exc
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=ray_address, **(init_kwargs or {}))
        self.spec_for = spec_for
        self.actor_cpus = actor_cpus
        self.gpus = gpus_per_replica or {}
        self._cls = ray.remote(KvyardWorkerActor)
        self._actors: list[_Actor] = []
        self._retiring: set[asyncio.Task] = set()
        self._next = 0

    def active(self, pool: PoolKey) -> list[_Actor]:
        return [a for a in self._actors if a.pool == pool and not a.retiring]

    async def get_replicas(self) -> dict[PoolKey, int]:
        out: dict[PoolKey, int] = {}
        for a in self._actors:
            out.setdefault(a.pool, 0)
            if not a.retiring:
                out[a.pool] += 1
        return out

    async def set_replicas(self, targets: dict[PoolKey, int]) -> dict[PoolKey, int]:
        for pool, n in targets.items():
            cur = self.active(pool)
            for _ in range(n - len(cur)):
                spec = self.spec_for(pool, self._next)
                self._next += 1
                handle = self._cls.options(num_cpus=self.actor_cpus, num_gpus=self.gpus.get(pool, 0)).remote(spec)
                a = _Actor(pool, handle, None)  # type: ignore[arg-type]
                a.started = asyncio.create_task(self._start(a))
                self._actors.append(a)
            for a in list(reversed(cur))[: max(0, len(cur) - n)]:
                a.retiring = True
                t = asyncio.create_task(self._retire(a))
                self._retiring.add(t)
                t.add_done_callback(self._retiring.discard)
        return {pool: len(self.active(pool)) for pool in targets}

    async def _start(self, a: _Actor) -> str | None:
        try:
            wid = await a.handle.start.remote()
            log.info("ray worker %s started for %s", wid, a.pool)
            return wid
        except Exception as exc:
            log.warning("ray worker for %s failed to start: %s", a.pool, exc)
            if a in self._actors:
                self._actors.remove(a)
            self._ray.kill(a.handle)
            return None

    async def _retire(self, a: _Actor) -> None:
        try:
            await asyncio.gather(a.started, return_exceptions=True)
            await a.handle.stop.remote()
        except Exception as exc:
            log.warning("ray worker of %s did not stop cleanly: %s", a.pool, exc)
        finally:
            self._ray.kill(a.handle)
            if a in self._actors:
                self._actors.remove(a)

    async def wait_started(self) -> list[str | None]:
        return await asyncio.gather(*(a.started for a in self._actors))

    async def wait_retired(self) -> None:
        if self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    async def close(self) -> None:
        await self.set_replicas({p: 0 for p in {a.pool for a in self._actors}})
        await self.wait_retired()
