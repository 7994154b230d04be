"""GET /api/pools (orchestrator/routes/dashboard.py) in process: per-pool summary and series from telemetry, targets, decisions;
an admin read (the token is needed, and never echoed)."""

from __future__ import annotations

import time

import httpx

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from planner.telemetry.schema import PoolBucket, PoolKey, TelemetryBatch
from planner.telemetry.targets import parse_targets


async def test_pools_endpoint_reads_telemetry_targets_and_decisions():
    app = create_app(FrontendConfig(grpc_port=0, security={"admin_token": "secret-token"}))
    store = app.state.telemetry_store
    b = PoolBucket(start=store.schema.bucket_start(time.time() - 20), requests=30, osl_sum=900, kv_hit_tokens=5,
                   kv_query_tokens=10, gauge_samples=2, workers_sum=4)
    for v in (100.0, 200.0, 300.0):
        b.ttft.observe(v)
    await store.write(TelemetryBatch(buckets={(PoolKey("m", "both"), b.start): b}))
    await store.append_decision({"tick": 1, "at": time.time(), "targets_version": 1, "reason": "r", "pools": []})
    await app.state.targets.put(parse_targets({"pools": [{"model": "m", "ttft_p90_ms": 250}, {"model": "idle"}], "gpu_budget": 4}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = await c.get("/api/pools?window=600", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
        c.headers["authorization"] = "Bearer secret-token"
        r = await c.get("/api/pools?window=600")
        assert r.status_code == 200
        body = r.json()
        assert "secret-token" not in r.text
        pools = {(p["model"], p["role"]): p for p in body["pools"]}
        assert set(pools) == {("m", "both"), ("idle", "both")}  # a pool with targets but no traffic is listed too
        m = pools[("m", "both")]
        assert m["summary"]["requests"] == 30 and m["summary"]["kv_hit_rate"] == 0.5
        assert m["summary"]["ttft_p90_ms"] == round(b.ttft.quantile(0.9), 1)
        assert m["series"][0]["replicas"] == 2.0 and m["series"][0]["request_rate"] == 3.0 and m["series"][0]["tokens_per_s"] == 90.0
        assert m["target"]["ttft_p90_ms"] == 250 and body["targets"] == {"version": 1, "updated_at": body["targets"]["updated_at"], "gpu_budget": 4}
        assert body["decisions"][0]["reason"] == "r"
        r = await c.get("/api/pools?window=abc")
        assert r.status_code == 400 and r.json()["error"]["param"] == "window"
        r = await c.get("/dashboard")
        assert r.status_code == 200 and "api/pools" in r.text and "admin/targets" in r.text
