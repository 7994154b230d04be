"""RayConnector: one Ray actor per worker; each actor runs a WorkerSupervisor (engine child process,
registered in discovery, drained on stop). Used by `kvyard up --ray` on a Ray cluster.

Scale up: a new named `KvyardWorkerActor` (num_cpus=actor_cpus, num_gpus=gpus_per_replica of its
pool — Ray then sets CUDA_VISIBLE_DEVICES for the actor and the engine it starts inherits it) is
created and `start()`ed in the background; it counts at once. An actor that is not up within
start_timeout_s (e.g. no node has the GPUs it asks for) is killed and drops out of the count.
Scale down: the newest actors are retired: `stop()` drains the worker (state=draining, in-flight
requests finish, deregister, engine stopped), then the actor is killed. An actor that dies drops out
of the count, so the next tick replaces it.
`spec_for(pool, ordinal)` returns the picklable `WorkerSpec` of a new worker. Ports are picked by the
actor on its own node (engine port 0, KV-event endpoints "auto"), since only it knows what is free there.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from planner.connectors.base import ConnectorError
from planner.connectors.ray_discovery import RAY_NAMESPACE
from planner.telemetry.schema import PoolKey
from workers.types import EngineLaunchConfig

__all__ = ["RayConnector", "WorkerSpec", "KvyardWorkerActor", "AUTO"]

log = logging.getLogger("kvyard.planner.ray")

AUTO = "auto"  # kv_events_endpoint / kv_replay_endpoint: a tcp:// endpoint on a free port of the actor's node


@dataclass
class WorkerSpec:
    backend: str
    engine: EngineLaunchConfig  # port 0: a free port on the actor's node; endpoints AUTO: likewise
    role: str
    redis_url: str | None = None  # discovery: Redis at this URL, else the hub below
    discovery_prefix: str = "kvyard"
    registry_secret: str | None = None  # signs the registry entries (workers/signing.py)
    discovery_hub: object | None = None  # a DiscoveryHub actor handle (planner/connectors/ray_discovery.py)
    worker_id: str | None = None
    lease_ttl_s: float = 6.0
    drain_timeout_s: float = 60.0
    tokenizer: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    advertise_host: str | None = None  # default: engine.host, or the Ray node's IP when the engine binds 0.0.0.0
    device: str | None = None  # vLLM, SGLang: cpu | cuda (default: cuda when Ray gave the actor a GPU)
    log_path: str | None = None  # engine log (a path on the actor's node); None: the actor's own log


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("", "*") else "0.0.0.0", 0))
        return s.getsockname()[1]


def _resolve_ports(cfg: EngineLaunchConfig) -> EngineLaunchConfig:
    host = cfg.host
    bind = "*" if host in ("0.0.0.0", "", "*") else host
    port = cfg.port or _free_port(host)
    kv = f"tcp://{bind}:{_free_port(host)}" if cfg.kv_events_endpoint == AUTO else cfg.kv_events_endpoint
    replay = f"tcp://{bind}:{_free_port(host)}" if cfg.kv_replay_endpoint == AUTO else cfg.kv_replay_endpoint
    return replace(cfg, port=port, kv_events_endpoint=kv, kv_replay_endpoint=replay, extra_args=list(cfg.extra_args),
                   env=dict(cfg.env))


class KvyardWorkerActor:
    """The actor body (wrapped with ray.remote by the connector, so importing this needs no Ray)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.sup = None
        self.task: asyncio.Task | None = None

    def _discovery(self):
        s = self.spec
        if s.discovery_hub is not None:
            from planner.connectors.ray_discovery import RayActorDiscovery

            return RayActorDiscovery(s.discovery_hub)
        from workers.discovery import RedisDiscovery

        if not s.redis_url:
            raise ConnectorError("a WorkerSpec needs a redis_url or a discovery_hub")
        return RedisDiscovery(s.redis_url, s.discovery_prefix, secret=s.registry_secret)

    def _backend(self):
        from workers.registry import DEVICE_BACKENDS, create_backend

        s = self.spec
        if s.backend in DEVICE_BACKENDS and s.device is None:
            import ray

            return create_backend(s.backend, "cuda" if ray.get_gpu_ids() else "cpu")
        return create_backend(s.backend, s.device)

    async def start(self) -> str:
        from workers.types import WorkerRole
        from workers.worker import WorkerOptions, WorkerSupervisor

        s = self.spec
        engine = _resolve_ports(s.engine)
        advertise = s.advertise_host
        if advertise is None and engine.host in ("0.0.0.0", "", "*"):
            import ray

            advertise = ray.util.get_node_ip_address()
        opts = WorkerOptions(role=WorkerRole(s.role), lease_ttl_s=s.lease_ttl_s, drain_timeout_s=s.drain_timeout_s,
                             worker_id=s.worker_id, tokenizer=s.tokenizer, labels=dict(s.labels), advertise_host=advertise,
                             log_path=s.log_path)
        self.sup = WorkerSupervisor(self._backend(), engine, self._discovery(), opts)
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
    name: str
    handle: object
    started: asyncio.Task | None = None  # result: the worker id, or None if it failed to start
    retiring: bool = False


class RayConnector:
    name = "ray"

    def __init__(self, spec_for: Callable[[PoolKey, int], WorkerSpec], *, actor_cpus: float = 0.5,
                 gpus_per_replica: float | dict[PoolKey, float] = 0.0, ray_address: str | None = None,
                 init_kwargs: dict | None = None, name_prefix: str = "kvyard", namespace: str = RAY_NAMESPACE,
                 start_timeout_s: float = 600.0, first_ordinal: int = 0) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ConnectorError("the ray connector needs ray: pip install 'kvyard[planner]'") from exc
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=ray_address, **(init_kwargs or {}))
        self.spec_for = spec_for
        self.actor_cpus = actor_cpus
        self.gpus = gpus_per_replica
        self.name_prefix = name_prefix
        self.namespace = namespace
        self.start_timeout_s = start_timeout_s
        self._cls = ray.remote(KvyardWorkerActor)
        self._actors: list[_Actor] = []
        self._retiring: set[asyncio.Task] = set()
        self._next = first_ordinal

    def gpus_for(self, pool: PoolKey) -> float:
        return float(self.gpus.get(pool, 0.0)) if isinstance(self.gpus, dict) else float(self.gpus)

    def active(self, pool: PoolKey) -> list[_Actor]:
        return [a for a in self._actors if a.pool == pool and not a.retiring]

    def actor_names(self) -> list[str]:
        """Named actors this connector owns (retiring ones included)."""
        return [a.name for a in self._actors]

    async def _prune_dead(self) -> None:
        """Drop started actors that died (actor process gone) or whose worker stopped (engine exited)."""
        from ray.exceptions import RayError

        up = [a for a in self._actors if not a.retiring and a.started is not None and a.started.done() and a.started.result()]
        if not up:
            return
        results = await asyncio.gather(*(asyncio.wait_for(a.handle.alive.remote(), 10.0) for a in up), return_exceptions=True)
        for a, ok in zip(up, results):
            if isinstance(ok, asyncio.TimeoutError):
                continue  # busy, not known dead: ask again next tick
            if ok is True:
                continue
            why = f"{type(ok).__name__}" if isinstance(ok, (RayError, Exception)) else "its worker stopped"
            log.warning("ray worker %s of %s is gone (%s); dropping it", a.name, a.pool, why)
            self._drop(a)

    def _drop(self, a: _Actor) -> None:
        if a in self._actors:
            self._actors.remove(a)
        try:
            self._ray.kill(a.handle)
        except Exception:  # already dead
            pass

    async def get_replicas(self) -> dict[PoolKey, int]:
        await self._prune_dead()
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
                self._spawn(pool)
            # retire starting actors first (they never served), then the newest running ones
            order = sorted(cur, key=lambda a: (a.started is not None and a.started.done(), -self._actors.index(a)))
            for a in order[: max(0, len(cur) - n)]:
                a.retiring = True
                t = asyncio.create_task(self._retire(a))
                self._retiring.add(t)
                t.add_done_callback(self._retiring.discard)
        return {pool: len(self.active(pool)) for pool in targets}

    def _spawn(self, pool: PoolKey) -> None:
        spec = self.spec_for(pool, self._next)
        self._next += 1
        name = f"{self.name_prefix}-{spec.worker_id or self._next - 1}"
        try:
            handle = self._cls.options(name=name, namespace=self.namespace, num_cpus=self.actor_cpus, num_gpus=self.gpus_for(pool),
                                       max_restarts=0).remote(spec)
        except ValueError as exc:  # e.g. a live actor already has this name
            raise ConnectorError(f"could not create ray actor {name}: {exc}") from exc
        a = _Actor(pool, name, handle)
        a.started = asyncio.create_task(self._start(a))
        self._actors.append(a)

    async def _start(self, a: _Actor) -> str | None:
        try:
            wid = await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(a.handle.start.remote())), self.start_timeout_s)
            log.info("ray worker %s started for %s (actor %s)", wid, a.pool, a.name)
            return wid
        except Exception as exc:
            log.warning("ray worker %s for %s failed to start: %s", a.name, a.pool, str(exc) or type(exc).__name__)
            if isinstance(exc, asyncio.TimeoutError):  # maybe mid-start: stop its engine before the kill
                await asyncio.gather(asyncio.wait_for(a.handle.stop.remote(), 30.0), return_exceptions=True)
            self._drop(a)
            return None

    async def _retire(self, a: _Actor) -> None:
        """Drain, then kill. One still starting finishes starting first: killing an actor mid-start
        would leave its engine process behind (it runs in its own session)."""
        try:
            if a.started is not None and not await a.started:
                return  # it failed to start and is already dropped
            await a.handle.stop.remote()
        except Exception as exc:
            log.warning("ray worker %s of %s did not stop cleanly: %s", a.name, a.pool, exc)
        finally:
            self._drop(a)

    async def wait_started(self) -> list[str | None]:
        return await asyncio.gather(*(a.started for a in self._actors if a.started is not None))

    async def wait_retired(self) -> None:
        if self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    async def close(self) -> None:
        await self.set_replicas({p: 0 for p in {a.pool for a in self._actors}})
        await self.wait_retired()
