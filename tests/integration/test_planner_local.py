"""LocalConnector for real: simulated engines under WorkerSupervisors. Scaling up starts and registers
workers; scaling down drains — the worker turns 'draining', its in-flight request finishes with every
token, then it deregisters and its engine stops. No request is lost."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from pathlib import Path

import httpx
import pytest

from planner.connectors.local import LocalConnector
from workers.discovery import InMemoryDiscovery
from workers.registry import get_backend
from planner.telemetry.schema import PoolKey
from workers.types import EngineLaunchConfig, WorkerRole, WorkerState
from workers.worker import WorkerOptions, WorkerSupervisor

pytestmark = pytest.mark.slow

POOL = PoolKey("tiny", "both")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def setup():
    tmp = Path(tempfile.mkdtemp(prefix="kvy-pl-"))
    discovery = InMemoryDiscovery()

    def factory(pool: PoolKey, i: int) -> WorkerSupervisor:
        cfg = EngineLaunchConfig(model="h200-llama3.1-8b", served_model_name=pool.model, port=free_port(), block_size=32,
                                 max_model_len=1024, extra_args=["--speedup", "0.25"])
        opts = WorkerOptions(role=WorkerRole(pool.role), worker_id=f"w{i}", drain_timeout_s=60, log_path=str(tmp / f"w{i}.log"))
        return WorkerSupervisor(get_backend("sim"), cfg, discovery, opts)

    conn = LocalConnector(factory)
    yield conn, discovery
    await conn.close()
    shutil.rmtree(tmp, ignore_errors=True)


async def test_scale_up_then_drain_without_losing_a_request(setup):
    conn, discovery = setup
    assert await conn.set_replicas({POOL: 2}) == {POOL: 2}
    assert await conn.get_replicas() == {POOL: 2}  # starting ones count
    await conn.wait_started(120)
    workers = {w.worker_id: w for w in await discovery.list_workers()}
    assert set(workers) == {"w0", "w1"}

    victim = workers["w1"]  # the newest goes first
    async with httpx.AsyncClient(timeout=120) as client:
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 300, "ignore_eos": True}
        inflight = asyncio.create_task(client.post(victim.url + "/v1/completions", json=body))
        await asyncio.sleep(1.0)
        assert not inflight.done()
        assert await conn.set_replicas({POOL: 1}) == {POOL: 1}
        assert await conn.get_replicas() == {POOL: 1}
        await asyncio.sleep(0.3)
        states = {w.worker_id: w.state for w in await discovery.list_workers()}
        assert states == {"w0": WorkerState.READY, "w1": WorkerState.DRAINING}
        resp = await inflight
    assert resp.status_code == 200
    out = resp.json()
    assert out["usage"]["completion_tokens"] == 300 and out["choices"][0]["finish_reason"] == "length"
    await conn.wait_drained(60)
    assert [w.worker_id for w in await discovery.list_workers()] == ["w0"]
    with pytest.raises(httpx.HTTPError):
        async with httpx.AsyncClient(timeout=2) as client:
            await client.get(victim.url + "/health")


async def test_scale_down_prefers_starting_workers(setup):
    conn, discovery = setup
    await conn.set_replicas({POOL: 1})
    await conn.wait_started(120)
    await conn.set_replicas({POOL: 3})
    await conn.set_replicas({POOL: 1})  # the two still starting are cancelled, the running one stays
    await conn.wait_drained(60)
    await asyncio.sleep(0.2)
    assert await conn.get_replicas() == {POOL: 1}
    assert [w.worker_id for w in await discovery.list_workers()] == ["w0"]
