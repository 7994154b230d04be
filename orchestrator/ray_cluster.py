"""`kvyard up --ray`: the cluster's workers as Ray actors, scaled by the planner's Ray connector.

    cluster = RayCluster(cluster_cfg, RayOptions(address=None, gpus_per_worker=1), redis_url=None)
    await cluster.start()              # ray.init, discovery, `cfg.workers` actors started and registered
    app = create_app(frontend_cfg, cluster.discovery)
    ... cluster.connector is the planner's RayConnector (pool = (served model name, "both")) ...
    await cluster.stop()               # every actor drained and killed; a Ray we started is shut down

Ray: `address` None starts a private local Ray cluster (`ray.init(address="local", num_cpus=...)`, no
dashboard, no usage stats); "auto" or "ray://host:10001" or "host:6379" joins an existing one (every
node needs kvyard installed in the same environment). Each worker is one named actor
(`kvyard-<run>-<worker id>` in Ray namespace "kvyard") reserving `actor_cpus` CPUs and
`gpus_per_worker` GPUs; it starts its engine as a child process on its node and registers it.
Discovery: Redis when a URL is given (frontends elsewhere can find the workers too), else a
`DiscoveryHub` actor (planner/connectors/ray_discovery.py) that this frontend and the actors share.
Engines bind `engine_host`: 127.0.0.1 by default (nothing listens beyond this machine; right for a
private cluster or a one-node one); on a multi-node cluster pass 0.0.0.0, and each engine then
advertises its node's IP to the frontend.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from dataclasses import dataclass

from orchestrator.config import ClusterConfig
from orchestrator.launcher import default_tokenizer, engine_config
from planner.connectors.ray import AUTO, RayConnector, WorkerSpec
from planner.connectors.ray_discovery import RAY_NAMESPACE, RayActorDiscovery, start_discovery_hub
from workers.discovery import Discovery, RedisDiscovery
from planner.telemetry.schema import PoolKey

__all__ = ["RayOptions", "RayCluster"]

log = logging.getLogger("kvyard.ray")


@dataclass
class RayOptions:
    address: str | None = None  # None: start a local Ray cluster in this process
    num_cpus: int | None = None  # local cluster only; default: enough for max_workers actors (at least 2)
    actor_cpus: float = 0.5  # CPUs each worker actor reserves
    gpus_per_worker: float = 0.0  # GPUs each worker actor reserves (Ray sets CUDA_VISIBLE_DEVICES)
    max_workers: int = 4  # used to size a local cluster's CPUs
    start_timeout_s: float = 600.0  # an actor not up by then (e.g. no GPU free) is given up
    engine_host: str = "127.0.0.1"  # engines bind here; 0.0.0.0: advertise the node's IP (multi-node)


class RayCluster:
    def __init__(self, cfg: ClusterConfig, opts: RayOptions, *, redis_url: str | None = None, prefix: str = "kvyard") -> None:
        if getattr(cfg, "prefill_workers", 0) or getattr(cfg, "decode_workers", 0):
            raise SystemExit("kvyard up --ray runs aggregated workers only (--workers N); "
                             "--prefill-workers/--decode-workers are for local processes")
        self.cfg = cfg
        self.opts = opts
        self.redis_url = redis_url
        self.prefix = prefix
        self.run_id = uuid.uuid4().hex[:6]
        self.pool = PoolKey(cfg.served_model_name, "both")
        self.discovery: Discovery | None = None
        self.connector: RayConnector | None = None
        self._hub = None
        self._owns_ray = False

    @property
    def local(self) -> bool:
        return self.opts.address is None

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.local:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            cpus = self.opts.num_cpus or max(2, math.ceil(self.opts.max_workers * self.opts.actor_cpus))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     namespace=RAY_NAMESPACE)
            log.info("started a local Ray cluster with %d CPUs", cpus)
        else:
            ray.init(address=self.opts.address, log_to_driver=False, configure_logging=False, namespace=RAY_NAMESPACE)
            log.info("joined the Ray cluster at %s", self.opts.address)
        self._owns_ray = True

    def spec_for(self, pool: PoolKey, i: int) -> WorkerSpec:
        c = self.cfg
        engine = engine_config(c, 0, AUTO, AUTO, host=self.opts.engine_host)
        engine.role = pool.role
        wid = f"{c.backend}-ray-{self.run_id}-{i}"
        return WorkerSpec(backend=c.backend, engine=engine, role=pool.role, redis_url=self.redis_url, discovery_prefix=self.prefix,
                          registry_secret=c.frontend.security.registry_secret, discovery_hub=self._hub, worker_id=wid,
                          tokenizer=default_tokenizer(c.backend, c.model, c.tokenizer),
                          labels={"ray_run": self.run_id}, device=None if c.device == "auto" else c.device,
                          log_path=str((c.log_dir / f"{wid}.log").resolve()) if self.local else None)

    async def start(self) -> None:
        self._init_ray()
        if self.redis_url:
            self.discovery = RedisDiscovery(self.redis_url, self.prefix, secret=self.cfg.frontend.security.registry_secret)
        else:
            self._hub = start_discovery_hub(f"kvyard-{self.run_id}:discovery")
            self.discovery = RayActorDiscovery(self._hub)
        if self.local:
            self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        self.connector = RayConnector(self.spec_for, actor_cpus=self.opts.actor_cpus, gpus_per_replica=self.opts.gpus_per_worker,
                                      name_prefix=f"kvyard-{self.run_id}", start_timeout_s=self.opts.start_timeout_s)
        await self.connector.set_replicas({self.pool: self.cfg.workers})
        started = await self.connector.wait_started()
        if not all(started):
            await self.stop()
            raise RuntimeError(f"{started.count(None)} of {self.cfg.workers} Ray workers failed to start (see the log above)")

    async def stop(self) -> None:
        """Drain and kill every worker actor, then the hub; shut down a Ray this cluster started."""
        import ray

        if self.connector is not None:
            await self.connector.close()
        if self.discovery is not None:
            await self.discovery.close()
        if self._hub is not None:
            ray.kill(self._hub)
            self._hub = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
