"""The planner loop on real Redis (a private redis-server): frontend telemetry flushed through the
aggregator, targets in Redis, decisions recorded there. Then a Redis outage (the server is frozen with
SIGSTOP): the planner holds still, the flusher keeps its data; after SIGCONT both recover."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid

import pytest

from planner.config import PlannerConfig
from planner.connectors import VirtualConnector
from planner.service import build_planner
from planner.telemetry import (
    PoolKey,
    RedisTargetsStore,
    RedisTelemetryStore,
    TelemetryAggregator,
    TelemetryFlusher,
    TelemetrySchema,
    parse_targets,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

P = PoolKey("m", "prefill")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def private_redis():
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield proc, f"redis://127.0.0.1:{port}/0"
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(10)


def record(agg: TelemetryAggregator, n: int = 600) -> None:
    now = time.time()
    for i in range(n):  # 10 req/s over the last minute, 9000-token prompts
        t = now - 60 + i * 60 / n
        agg.record_arrival("m", "prefill", now=t)
        agg.record_request("m", "prefill", ttft_s=0.15, duration_s=0.2, isl=9000, osl=2, now=t)


async def test_planner_holds_through_a_redis_outage_and_recovers(private_redis):
    proc, url = private_redis
    schema = TelemetrySchema(prefix=f"kvyard-test-{uuid.uuid4().hex[:8]}")
    telemetry = RedisTelemetryStore(url, schema, timeout_s=0.5)
    targets = RedisTargetsStore(url, prefix=schema.prefix, timeout_s=0.5)
    await targets.put(parse_targets({"pools": [{"model": "m", "role": "prefill", "ttft_p90_ms": 300, "max_replicas": 16}]}))
    agg = TelemetryAggregator(schema)
    flusher = TelemetryFlusher(agg, RedisTelemetryStore(url, schema, timeout_s=0.5))
    conn = VirtualConnector({P: 1})
    cfg = PlannerConfig(mode="sla", predictor="constant", scale_down_cooldown_s=0)
    loop = build_planner(cfg, telemetry, targets, conn)

    record(agg)
    assert await flusher.flush()
    d = await loop.tick()
    first = d.pools[0].desired
    assert first > 1 and conn.replicas[P] == first, d.pools[0].reason

    os.kill(proc.pid, signal.SIGSTOP)  # Redis stops answering
    record(agg, 1200)                  # demand doubles meanwhile
    assert not await flusher.flush()   # kept in memory
    assert agg.pending > 0
    d = await loop.tick()
    assert not d.changed and d.pools[0].held and "unreachable" in d.pools[0].reason
    assert conn.replicas[P] == first

    os.kill(proc.pid, signal.SIGCONT)  # back
    assert await flusher.flush()
    d = await loop.tick()
    assert d.pools[0].desired > first and not d.pools[0].held
    recs = await telemetry.recent_decisions()
    assert len(recs) == 3 and "unreachable" in recs[1]["pools"][0]["reason"]  # the held tick was recorded late
    for c in (telemetry, targets, flusher.store):
        await c.close()
