"""`kvyard planner` in-process (orchestrator/planner_cmd.py) on real Redis with the virtual connector:
the YAML's initial targets are stored once, the loop ticks and records its decisions in Redis."""

from __future__ import annotations

import argparse
import asyncio
import uuid

import pytest
import yaml

from orchestrator.planner_cmd import add_planner_parser, run_planner_command
from planner.telemetry import RedisTargetsStore, RedisTelemetryStore, TelemetrySchema

pytestmark = pytest.mark.redis


async def test_planner_command_seeds_targets_and_records_decisions(redis_url, tmp_path):
    prefix = f"kvyard-test-{uuid.uuid4().hex[:8]}"
    cfg = {"connector": "virtual", "metrics_port": 0,
           "planner": {"mode": "sla", "interval_s": 0.2, "predictor": "constant"},
           "targets": {"pools": [{"model": "m", "role": "decode", "itl_p90_ms": 30, "min_replicas": 2, "max_replicas": 4}]}}
    path = tmp_path / "planner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ap = argparse.ArgumentParser()
    add_planner_parser(ap.add_subparsers(dest="command"))
    ns = ap.parse_args(["planner", "--redis-url", redis_url, "--discovery-prefix", prefix, "--config", str(path)])
    stop = asyncio.Event()
    task = asyncio.create_task(run_planner_command(ns, stop))
    tel = RedisTelemetryStore(redis_url, TelemetrySchema(prefix=prefix))
    targets = RedisTargetsStore(redis_url, prefix=prefix)
    try:
        for _ in range(50):
            recs = await tel.recent_decisions()
            if recs:
                break
            await asyncio.sleep(0.1)
        assert recs, "no decision recorded"
        pool = recs[-1]["pools"][0]
        assert (pool["current"], pool["desired"]) == (0, 2) and "min_replicas is 2" in pool["reason"]
        assert recs[-1]["applied"] == {"m/decode": 2}
        vt = await targets.get()
        assert vt.version == 1 and vt.updated_by == "planner-config"
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
        await tel.close()
        await targets.close()
