"""The planner loop: observe (telemetry + targets + connector) -> decide (core) -> act (connector)
-> record (decision log in the telemetry store, Prometheus gauges). The only I/O of the planner.

    tick():  obs = observe(now); d = core.on_tick(now, obs); applied = act(d); record(d, applied)
Failures never stop the loop:
  - telemetry store unreachable: the observation says so and the core holds every pool still;
    decision records that could not be written wait in a bounded queue and go out once it is back;
  - targets unreachable: the last targets read are used (with the telemetry hold above);
  - connector unreadable: the tick holds (nothing is applied); connector write failed: logged,
    the next tick reads the real counts and decides again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from planner.connectors.base import ConnectorError, PlannerConnector
from planner.core import PlannerCore
from planner.metrics import PlannerMetrics
from planner.types import Decision, Observation, PoolObservation
from planner.telemetry.schema import PoolKey, merge_buckets
from planner.telemetry.store import TelemetryStore, TelemetryUnavailableError
from planner.telemetry.targets import TargetsStore, TargetsUnavailableError, VersionedTargets

__all__ = ["PlannerLoop"]

log = logging.getLogger("kvyard.planner")


class PlannerLoop:
    def __init__(self, core: PlannerCore, telemetry: TelemetryStore, targets: TargetsStore, connector: PlannerConnector,
                 metrics: PlannerMetrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self.core = core
        self.telemetry = telemetry
        self.targets = targets
        self.connector = connector
        self.metrics = metrics or PlannerMetrics()
        self.clock = clock
        self.last_targets: VersionedTargets | None = None
        self.last_decision: Decision | None = None
        self._unrecorded: deque[dict] = deque(maxlen=100)
        self._task: asyncio.Task | None = None

    # ---- observe -------------------------------------------------------------------------------
    async def observe(self, now: float) -> Observation:
        notes: list[str] = []
        targets_ok = True
        try:
            self.last_targets = await self.targets.get()
        except TargetsUnavailableError as exc:
            targets_ok = False  # keep the last targets read; hold while the store is away
            notes.append(f"targets: {exc}")
        try:
            replicas = await self.connector.get_replicas()
        except ConnectorError as exc:
            return Observation(self.last_targets, {}, telemetry_ok=False, note=f"connector: {exc}")
        schema = self.telemetry.schema
        since = schema.bucket_start(now - self.core.cfg.window)
        try:
            buckets = await self.telemetry.read_pool_buckets(since, now + 1)
            samples = await self.telemetry.read_workers(now)
            telemetry_ok = targets_ok
        except TelemetryUnavailableError as exc:
            buckets, samples, telemetry_ok = {}, [], False
            notes.append(f"telemetry: {exc}")
        pools: dict[PoolKey, PoolObservation] = {}
        keys = set(replicas) | set(buckets)
        if self.last_targets is not None:
            keys |= {PoolKey(p.model, p.role.value) for p in self.last_targets.targets.pools}
        for key in keys:
            po = PoolObservation(key, replicas.get(key, 0))
            bs = buckets.get(key)
            if bs:
                po.stats = merge_buckets(key, bs, window_s=max(now - since, 1.0))
                po.data_age_s = max(0.0, now - (bs[-1].start + schema.bucket_s))
            mine = [s for s in samples if s.model == key.model and s.role == key.role]
            po.worker_queue = [s.metrics.num_requests_waiting for s in mine]
            po.worker_kv = [s.metrics.kv_cache_usage for s in mine]
            pools[key] = po
        return Observation(self.last_targets, pools, telemetry_ok=telemetry_ok, note="; ".join(notes))

    # ---- act and record ------------------------------------------------------------------------
    async def act(self, d: Decision) -> tuple[dict[PoolKey, int] | None, str | None]:
        wanted = d.replica_targets()
        if d.advisory or not wanted:
            return None, None
        try:
            return await self.connector.set_replicas(wanted), None
        except ConnectorError as exc:
            log.warning("could not apply %s: %s", {str(k): v for k, v in wanted.items()}, exc)
            return None, str(exc)

    async def record(self, d: Decision, applied: dict[PoolKey, int] | None, error: str | None) -> None:
        rec = d.as_dict()
        rec["applied"] = {str(k): v for k, v in applied.items()} if applied is not None else None
        rec["error"] = error
        self._unrecorded.append(rec)
        try:
            while self._unrecorded:
                await self.telemetry.append_decision(self._unrecorded[0])
                self._unrecorded.popleft()
        except TelemetryUnavailableError:
            pass  # kept (bounded) until the store is back

    async def tick(self) -> Decision:
        now = self.clock()
        obs = await self.observe(now)
        d = self.core.on_tick(now, obs)
        applied, error = await self.act(d)
        await self.record(d, applied, error)
        outcome = "error" if error else "advisory" if d.advisory and d.changed else "scaled" if applied else "hold" if not obs.telemetry_ok else "steady"
        self.metrics.observe(d, applied, obs.telemetry_ok, outcome)
        for p in d.pools:
            if p.changed or p.held:
                log.info("%s %s %d -> %d: %s", "advise" if d.advisory else "scale", p.pool, p.current, p.desired, p.reason)
        self.last_decision = d
        return d

    # ---- running -------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # the loop must outlive any one bad tick
                log.exception("planner tick failed")
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.core.cfg.interval_s)
            except asyncio.TimeoutError:
                pass

    def start(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.create_task(self.run())
        return self._task

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
