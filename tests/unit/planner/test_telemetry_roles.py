"""Pools by role: the frontend's telemetry attributes a request to the prefill and decode pools from
the roles of the model's live workers (orchestrator/telemetry_recorder.py), and the planner then
sizes prefill on the TTFT target and decode on the ITL target, each pool on its own."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from orchestrator.telemetry_recorder import FrontendTelemetry
from planner.config import PlannerConfig
from planner.connectors import VirtualConnector
from planner.core import PlannerCore
from planner.loop import PlannerLoop
from planner.telemetry import InMemoryTargetsStore, InMemoryTelemetryStore, PoolKey, merge_buckets, parse_targets
from workers.types import EngineMetrics, WorkerInfo, WorkerRole

from .conftest import toy_perf

P, D, B = PoolKey("m", "prefill"), PoolKey("m", "decode"), PoolKey("m", "both")


def pool_of(*roles: str, model: str = "m") -> SimpleNamespace:
    workers = {f"{r}-{i}": SimpleNamespace(info=WorkerInfo(worker_id=f"{r}-{i}", model=model, backend="sim", url="http://x",
                                                           role=WorkerRole(r)), metrics=EngineMetrics())
               for i, r in enumerate(roles)}
    return SimpleNamespace(workers=workers, on_worker_joined=[])


def record(tel: FrontendTelemetry, n: int = 20, *, ttft_s: float = 0.2, itl_s: float = 0.01, isl: int = 9000, osl: int = 100,
           model: str = "m", **kw) -> None:
    for _ in range(n):
        tel.on_arrival(model, **kw)
        tel.on_finish(model, ttft_s=ttft_s, duration_s=ttft_s + itl_s * (osl - 1), isl=isl, osl=osl, **kw)


async def pool_stats(tel: FrontendTelemetry) -> dict:
    await tel.flusher.flush()
    now = time.time()
    got = await tel.store.read_pool_buckets(now - 60, now + 10)
    return {k: merge_buckets(k, v, 60.0) for k, v in got.items()}


@pytest.mark.parametrize("roles,expected", [
    (("both", "both"), (None, "both")),
    (("prefill", "decode"), ("prefill", "decode")),
    (("prefill", "both"), ("prefill", "both")),
    (("decode",), (None, "decode")),
    (("decode", "both"), (None, "both")),
    ((), (None, "both")),  # no live worker yet: aggregated, as before
])
def test_pools_follow_worker_roles(roles, expected):
    tel = FrontendTelemetry.for_pool(InMemoryTelemetryStore(), pool_of(*roles))
    assert tel.pools_for("m") == expected
    assert tel.pools_for("other-model") == (None, "both")


async def test_disaggregated_request_splits_ttft_to_prefill_and_itl_to_decode():
    tel = FrontendTelemetry.for_pool(InMemoryTelemetryStore(), pool_of("prefill", "decode", "decode"))
    record(tel, ttft_s=0.2, itl_s=0.01)
    s = await pool_stats(tel)
    assert set(s) == {P, D}
    pre, dec = s[P], s[D]
    assert (pre.requests, dec.requests) == (20, 20)
    assert pre.arrival_rate == dec.arrival_rate == pytest.approx(20 / 60)
    assert pre.avg_isl == dec.avg_isl == 9000
    assert pre.ttft_p90_ms == pytest.approx(200, rel=0.1)
    assert pre.itl_p90_ms is None  # the prompt's part has no inter-token latency
    assert dec.itl_p90_ms == pytest.approx(10, rel=0.1)
    assert pre.workers == 1 and dec.workers == 2  # gauges by each worker's own role


async def test_aggregated_and_explicit_roles():
    tel = FrontendTelemetry.for_pool(InMemoryTelemetryStore(), pool_of("both"))
    record(tel, n=5)
    record(tel, n=3, role="prefill")  # an explicit role is recorded there only
    s = await pool_stats(tel)
    assert s[B].requests == 5 and s[B].itl_p90_ms == pytest.approx(10, rel=0.1)
    assert s[P].requests == 3 and D not in s


async def test_roles_view_refreshes_after_its_ttl():
    pool = pool_of("both")
    now = [0.0]
    tel = FrontendTelemetry(InMemoryTelemetryStore(), lambda: [(w.info, w.metrics) for w in pool.workers.values()],
                            clock=lambda: now[0])
    assert tel.pools_for("m") == (None, "both")
    pool.workers = pool_of("prefill", "decode").workers  # the deployment went disaggregated
    assert tel.pools_for("m") == (None, "both")  # cached within the TTL
    now[0] += FrontendTelemetry.ROLES_TTL_S
    assert tel.pools_for("m") == ("prefill", "decode")


def test_a_broken_worker_view_keeps_the_last_roles():
    calls = [0]

    def workers():
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("boom")
        return [(w.info, w.metrics) for w in pool_of("prefill", "decode").workers.values()]

    now = [0.0]
    tel = FrontendTelemetry(InMemoryTelemetryStore(), workers, clock=lambda: now[0])
    assert tel.pools_for("m") == ("prefill", "decode")
    now[0] += 10
    assert tel.pools_for("m") == ("prefill", "decode")


async def _plan(ttft_ms: float, itl_ms: float) -> dict[PoolKey, int]:
    """Telemetry of a disaggregated model recorded as the frontend does, then one planner tick."""
    tel = FrontendTelemetry.for_pool(InMemoryTelemetryStore(), pool_of("prefill", "decode"))
    record(tel, n=3000, ttft_s=0.2, itl_s=0.01, isl=9000, osl=100)  # 50 req/s over the 60 s window
    await tel.flusher.flush()
    targets = InMemoryTargetsStore()
    await targets.put(parse_targets({"pools": [
        {"model": "m", "role": "prefill", "ttft_p90_ms": ttft_ms, "min_replicas": 1, "max_replicas": 50},
        {"model": "m", "role": "decode", "itl_p90_ms": itl_ms, "min_replicas": 1, "max_replicas": 50}]}))
    cfg = PlannerConfig(mode="sla", predictor="constant", demand_z=0.0, max_step=100, scale_down_window_s=0, scale_down_cooldown_s=0)
    schema = tel.store.schema
    now = schema.bucket_start(time.time()) + schema.bucket_s / 2  # a fixed point in the bucket: the same window every run
    loop = PlannerLoop(PlannerCore(cfg, default_perf=toy_perf()), tel.store, targets, VirtualConnector({P: 1, D: 1}),
                       clock=lambda: now)
    d = await loop.tick()
    by = {p.pool: p for p in d.pools}
    assert "prefill" in by[P].reason and "TTFT" in by[P].reason
    assert "B*=" in by[D].reason and "ITL" in by[D].reason
    return {k: p.desired for k, p in by.items()}


async def test_planner_sizes_prefill_on_ttft_and_decode_on_itl():
    base = await _plan(ttft_ms=500, itl_ms=15)
    tighter_ttft = await _plan(ttft_ms=120, itl_ms=15)
    tighter_itl = await _plan(ttft_ms=500, itl_ms=8)
    assert tighter_ttft[P] > base[P] and tighter_ttft[D] == base[D]
    assert tighter_itl[D] > base[D] and tighter_itl[P] == base[P]
