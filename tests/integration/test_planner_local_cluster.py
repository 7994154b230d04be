"""`kvyard up`'s cluster under the planner's local connector (orchestrator/local_scaling.py): the
cluster's own worker is adopted, new ones are built like it, scale-down drains the newest."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from orchestrator.config import ClusterConfig
from orchestrator.launcher import LocalCluster
from orchestrator.local_scaling import local_connector
from orchestrator.testing import free_port_pair
from workers.discovery import InMemoryDiscovery
from planner.telemetry.schema import PoolKey

pytestmark = pytest.mark.slow


async def test_adopt_scale_up_and_down():
    tmp = Path(tempfile.mkdtemp(prefix="kvy-lc-"))
    cfg = ClusterConfig(workers=1, backend="sim", base_port=free_port_pair(), speedup=20, log_dir=tmp / "logs", served_model_name="sim-m")
    discovery = InMemoryDiscovery()
    cluster = LocalCluster(cfg, discovery)
    await cluster.start()
    conn = local_connector(cluster)
    pool = PoolKey("sim-m", "both")
    try:
        assert await conn.get_replicas() == {pool: 1}
        assert await conn.set_replicas({pool: 2}) == {pool: 2}
        await conn.wait_started(120)
        assert sorted(w.worker_id for w in await discovery.list_workers()) == ["sim-0", "sim-1"]
        assert await conn.set_replicas({pool: 1}) == {pool: 1}
        await conn.wait_drained(60)
        assert [w.worker_id for w in await discovery.list_workers()] == ["sim-0"]
    finally:
        await conn.close()
        await cluster.stop()
    assert await discovery.list_workers() == []
