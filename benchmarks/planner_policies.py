"""The four ways of sizing the pools that `planner_sim.py` compares, all driving one DisaggSim.

    planner   kvyard's PlannerLoop for real (PlannerCore + in-memory telemetry and targets stores +
              a connector on the sim), fed by TelemetryAggregator exactly as the frontend would be
    static    fixed counts (the oracle's peak) for the whole run
    keda      the KEDA rule of reference/peers.md §2 (vLLM production-stack): every 15 s,
              desired = ceil(Σ waiting / 5) per pool (HPA AverageValue), scale-up at once,
              scale-down to the highest recommendation of the last 360 s (cooldown)
    oracle    knows the future: at each minute it tries counts on a copy of the simulation and keeps
              the smallest prefill count, then decode count, that meet both targets in that minute;
              its replicas are ready on time (started early: the start-up is still billed)
"""

from __future__ import annotations

import copy
import math
from collections import deque

from benchmarks.planner_model import DisaggSim
from planner.config import PlannerConfig
from planner.core import PlannerCore
from planner.loop import PlannerLoop
from planner.perf_model import PerfModel
from workers.telemetry import InMemoryTargetsStore, InMemoryTelemetryStore, PoolKey, TelemetryAggregator, TelemetrySchema, parse_targets
from workers.types import EngineMetrics, WorkerInfo, WorkerRole

__all__ = ["SimConnector", "PlannerPolicy", "KedaPolicy", "oracle_minute"]

MODEL = "llama-3.1-8b"
PRE, DEC = PoolKey(MODEL, "prefill"), PoolKey(MODEL, "decode")


class SimConnector:
    """PlannerConnector on the simulation (get = active replicas, set = sim.scale)."""

    name = "sim"

    def __init__(self, sim: DisaggSim) -> None:
        self.sim = sim

    async def get_replicas(self) -> dict[PoolKey, int]:
        p, d = self.sim.replicas()
        return {PRE: p, DEC: d}

    async def set_replicas(self, targets: dict[PoolKey, int]) -> dict[PoolKey, int]:
        p, d = self.sim.replicas()
        self.sim.scale(targets.get(PRE, p), targets.get(DEC, d))
        p, d = self.sim.replicas()
        return {k: (p if k == PRE else d) for k in targets}

    async def close(self) -> None:
        return None


class PlannerPolicy:
    def __init__(self, sim: DisaggSim, perf: PerfModel, cfg: PlannerConfig, targets: dict, flush_s: float = 1.0) -> None:
        self.sim = sim
        clock = lambda: sim.now  # noqa: E731 - the virtual clock
        self.store = InMemoryTelemetryStore(TelemetrySchema(bucket_s=10), clock=clock)
        self.agg = TelemetryAggregator(self.store.schema, clock=clock)
        self.targets = InMemoryTargetsStore()
        self.targets_doc = parse_targets(targets)
        self.loop = PlannerLoop(PlannerCore(cfg, default_perf=perf), self.store, self.targets, SimConnector(sim), clock=clock)
        self.flush_s = flush_s
        self.next_tick = cfg.interval_s  # the first tick has one window of telemetry to read
        self.next_flush = 0.0
        self.seen = 0
        self.ttft: dict[int, float] = {}

    async def setup(self) -> None:
        await self.targets.put(self.targets_doc)

    def _infos(self, role: WorkerRole, n: int) -> list[WorkerInfo]:
        return [WorkerInfo(worker_id=f"{role.value}-{i}", model=MODEL, backend="sim", url="http://sim", role=role) for i in range(n)]

    async def before_step(self) -> None:
        sim, r = self.sim, self.sim.r
        events = sim.events
        for ev in events[self.seen:]:
            kind, _, q, t = ev[0], ev[1], ev[2], ev[3]
            if kind == "arrive":  # the frontend admits a request for both pools at once
                self.agg.record_arrival(MODEL, "prefill", now=t)
                self.agg.record_arrival(MODEL, "decode", now=t)
            elif kind == "admit":
                ttft = ev[4]
                self.agg.record_request(MODEL, "prefill", ttft_s=ttft, duration_s=ttft, isl=int(r.isl[q]), osl=1, now=t)
                self.ttft[q] = ttft
            elif kind == "done":
                t0 = float(r.t[q])
                ttft = self.ttft.pop(q, None)
                self.agg.record_request(MODEL, "decode", ttft_s=ttft, duration_s=t - t0, isl=int(r.isl[q]), osl=int(r.osl[q]), now=t)
        self.seen = len(events)
        if len(events) > 100_000:  # keep memory flat
            del events[: self.seen]
            self.seen = 0
        if sim.now >= self.next_flush:
            pre, dec = sim.gauges()
            pairs = []
            for role, gs in ((WorkerRole.PREFILL, pre), (WorkerRole.DECODE, dec)):
                for info, g in zip(self._infos(role, len(gs)), gs):
                    pairs.append((info, EngineMetrics(num_requests_waiting=g["waiting"], num_requests_running=g["running"],
                                                      kv_cache_usage=g["kv"], prefix_cache_hits=g["hits"],
                                                      prefix_cache_queries=g["queries"], scraped_at=sim.now)))
            self.agg.record_workers(pairs, now=sim.now)
            await self.store.write(self.agg.drain())
            self.next_flush += self.flush_s
        if sim.now >= self.next_tick:
            await self.loop.tick()
            self.next_tick += self.loop.core.cfg.interval_s


class KedaPolicy:
    def __init__(self, sim: DisaggSim, threshold: float = 5.0, polling_s: float = 15.0, cooldown_s: float = 360.0,
                 min_replicas: int = 1, max_replicas: int = 32) -> None:
        self.sim, self.threshold, self.polling_s, self.cooldown_s = sim, threshold, polling_s, cooldown_s
        self.min, self.max = min_replicas, max_replicas
        self.recent: tuple[deque, deque] = (deque(), deque())
        self.next_tick = 0.0

    def _desired(self, pool: int, waiting: int, current: int) -> int:
        rec = max(self.min, min(self.max, math.ceil(waiting / self.threshold)))
        hist = self.recent[pool]
        hist.append((self.sim.now, rec))
        while hist and hist[0][0] < self.sim.now - self.cooldown_s:
            hist.popleft()
        if rec >= current:
            return rec
        return max(rec, min(current, max(v for _, v in hist)))

    async def before_step(self) -> None:
        if self.sim.now < self.next_tick:
            return
        self.next_tick += self.polling_s
        qp, qd = self.sim.waiting()
        p, d = self.sim.replicas()
        self.sim.scale(self._desired(0, qp, p), self._desired(1, qd, d))


def oracle_minute(sim: DisaggSim, minute_slices: int, ttft_ms: float, itl_ms: float, pmax: int, dmax: int,
                  prev: tuple[int, int]) -> tuple[int, int]:
    """The smallest (prefill, decode) that meet both targets over the next minute, found on copies."""
    minutes, events = sim.minutes, sim.events
    sim.minutes, sim.events = {}, None
    try:
        snap = copy.deepcopy(sim, memo={id(sim.r): sim.r, id(sim.perf): sim.perf, id(sim.cfg): sim.cfg})
    finally:
        sim.minutes, sim.events = minutes, events
    m = int(round(sim.now / 60.0))

    def ok(p: int, d: int) -> bool:
        s = copy.deepcopy(snap, memo={id(snap.r): snap.r, id(snap.perf): snap.perf, id(snap.cfg): snap.cfg})
        s.scale(p, d, startup_s=0.0)
        for _ in range(minute_slices):
            s.step()
        return s.minute_ok(m, ttft_ms, itl_ms)[0]

    def smallest(lo: int, hi: int, test) -> int:
        if not test(hi):
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if test(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    p = smallest(1, pmax, lambda n: ok(n, dmax))
    d = smallest(1, dmax, lambda n: ok(p, n))
    return p, d
