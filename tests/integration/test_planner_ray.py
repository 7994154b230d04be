"""RayConnector on a real local Ray cluster: each worker is a Ray actor running a simulated engine
under a WorkerSupervisor, registered in Redis. Scale up to 2, then down to 1 (drained, then killed)."""

from __future__ import annotations

import socket
import uuid

import pytest

from workers.discovery import RedisDiscovery
from planner.telemetry.schema import PoolKey
from workers.types import EngineLaunchConfig
from orchestrator.testing.ray_local import start_local_ray

pytestmark = [pytest.mark.slow, pytest.mark.redis]

POOL = PoolKey("tiny", "decode")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = start_local_ray(num_cpus=2)  # once more if Ray's 30 s start-up window runs out on a loaded machine
    yield ray
    ray.shutdown()


async def test_ray_actors_scale_up_and_drain(ray_cluster, redis_url):
    from planner.connectors.ray import RayConnector, WorkerSpec

    prefix = f"kvyard-test-{uuid.uuid4().hex[:8]}"

    def spec_for(pool: PoolKey, i: int) -> WorkerSpec:
        cfg = EngineLaunchConfig(model="h200-llama3.1-8b", served_model_name=pool.model, port=free_port(),
                                 block_size=32, max_model_len=1024, extra_args=["--speedup", "10"])
        return WorkerSpec(backend="sim", engine=cfg, role=pool.role, redis_url=redis_url, discovery_prefix=prefix,
                          worker_id=f"ray-{i}", drain_timeout_s=10)

    conn = RayConnector(spec_for, actor_cpus=0.5)
    discovery = RedisDiscovery(redis_url, prefix)
    try:
        assert await conn.set_replicas({POOL: 2}) == {POOL: 2}
        assert sorted(await conn.wait_started()) == ["ray-0", "ray-1"]
        listed = await discovery.list_workers()
        assert sorted(w.worker_id for w in listed) == ["ray-0", "ray-1"]
        assert {w.role.value for w in listed} == {"decode"}
        assert await conn.set_replicas({POOL: 1}) == {POOL: 1}
        await conn.wait_retired()
        assert await conn.get_replicas() == {POOL: 1}
        assert [w.worker_id for w in await discovery.list_workers()] == ["ray-0"]
    finally:
        await conn.close()
        await discovery.close()
    assert await conn.get_replicas() == {}
