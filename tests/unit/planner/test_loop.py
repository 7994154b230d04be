"""PlannerLoop on in-memory stores and the virtual connector: observe -> decide -> act -> record,
and holding still through a telemetry outage, then recovering."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from planner.config import PlannerConfig
from planner.connectors import ConnectorError, VirtualConnector
from planner.core import PlannerCore
from planner.loop import PlannerLoop
from planner.telemetry import (
    InMemoryTargetsStore,
    InMemoryTelemetryStore,
    PoolKey,
    TelemetryAggregator,
    TelemetryUnavailableError,
    parse_targets,
)
from workers.types import EngineMetrics, WorkerInfo, WorkerRole

from .conftest import toy_perf

P = PoolKey("m", "prefill")
NOW = 10_000.0


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FlakyStore(InMemoryTelemetryStore):
    down = False

    async def _check(self):
        if self.down:
            raise TelemetryUnavailableError("redis unavailable: connection refused")

    async def read_pool_buckets(self, since, until):
        await self._check()
        return await super().read_pool_buckets(since, until)

    async def read_workers(self, now=None):
        await self._check()
        return await super().read_workers(now)

    async def append_decision(self, record):
        await self._check()
        await super().append_decision(record)


class BrokenConnector(VirtualConnector):
    async def set_replicas(self, targets):
        raise ConnectorError("kubernetes API: 403 Forbidden")


async def feed(store, clock, rate=50.0, isl=9000, window=60):
    """`rate` req/s over the last `window` s, plus one worker sample."""
    agg = TelemetryAggregator(store.schema, clock=clock)
    for i in range(int(rate * window)):
        t = clock.t - window + i / rate
        agg.record_arrival("m", "prefill", now=t)
        agg.record_request("m", "prefill", ttft_s=0.2, duration_s=0.3, isl=isl, osl=2, now=t)
    info = WorkerInfo(worker_id="w0", model="m", backend="sim", url="http://x", role=WorkerRole.PREFILL)
    agg.record_workers([(info, EngineMetrics(num_requests_waiting=0.5))], now=clock.t)
    await store.write(agg.drain())


async def make(advisory=False, connector=None):
    clock = Clock()
    store = FlakyStore(clock=clock)
    targets = InMemoryTargetsStore()
    await targets.put(parse_targets({"pools": [{"model": "m", "role": "prefill", "ttft_p90_ms": 500, "max_replicas": 20}]}))
    conn = connector or VirtualConnector({P: 2}, clock=clock)
    core = PlannerCore(PlannerConfig(mode="sla", predictor="constant", advisory=advisory, scale_down_cooldown_s=0, max_step=10),
                       default_perf=toy_perf())
    return PlannerLoop(core, store, targets, conn, clock=clock), store, clock, conn


async def test_tick_scales_records_and_exports():
    loop, store, clock, conn = await make()
    await feed(store, clock)
    d = await loop.tick()
    assert d.pools[0].desired == 6 and conn.replicas[P] == 6
    (rec,) = await store.recent_decisions()
    assert rec["applied"] == {"m/prefill": 6} and rec["pools"][0]["reason"].startswith("SLA: prefill")
    text = generate_latest(loop.metrics.registry).decode()
    assert 'kvyard_planner_desired_replicas{model="m",role="prefill"} 6.0' in text
    assert 'kvyard_planner_applied_replicas{model="m",role="prefill"} 6.0' in text
    assert 'kvyard_planner_ticks_total{outcome="scaled"} 1.0' in text


async def test_advisory_records_but_does_not_apply():
    loop, store, clock, conn = await make(advisory=True)
    await feed(store, clock)
    d = await loop.tick()
    assert d.advisory and d.pools[0].desired == 6
    assert conn.replicas[P] == 2 and conn.log == []
    assert (await store.recent_decisions())[0]["applied"] is None


async def test_telemetry_outage_holds_then_recovers():
    loop, store, clock, conn = await make()
    await feed(store, clock)
    store.down = True
    d = await loop.tick()
    assert d.pools[0].desired == 2 and "unreachable" in d.pools[0].reason and conn.log == []
    clock.t += 60
    d = await loop.tick()  # still down: still holding; two records wait in memory
    assert not d.changed and len(loop._unrecorded) == 2
    store.down = False
    await feed(store, clock)
    d = await loop.tick()
    assert d.pools[0].desired == 6 and conn.replicas[P] == 6
    recs = await store.recent_decisions()
    assert len(recs) == 3 and "unreachable" in recs[2]["pools"][0]["reason"]


async def test_stale_telemetry_holds():
    loop, store, clock, conn = await make()
    await feed(store, clock)
    clock.t += 45  # newest data 45 s old: inside the 60 s window but past stale_after_s (30 s)
    d = await loop.tick()
    assert d.pools[0].desired == 2 and "old" in d.pools[0].reason


async def test_connector_failure_is_recorded_and_next_tick_retries():
    loop, store, clock, conn = await make(connector=BrokenConnector({P: 2}))
    await feed(store, clock)
    await loop.tick()
    rec = (await store.recent_decisions())[0]
    assert rec["error"] == "kubernetes API: 403 Forbidden" and rec["applied"] is None
    assert 'outcome="error"' in generate_latest(loop.metrics.registry).decode()


@pytest.mark.parametrize("targets_set", [False])
async def test_no_targets_means_no_action(targets_set):
    loop, store, clock, conn = await make()
    loop.targets = InMemoryTargetsStore()
    await feed(store, clock)
    d = await loop.tick()
    assert d.pools == [] and conn.log == []
