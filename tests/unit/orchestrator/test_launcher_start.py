"""`kvyard up`'s local cluster: each worker keeps its lease from the moment it registers, not once the slowest
engine is up; a failed start stops every worker; engines get the cluster's CPU list."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from orchestrator.config import ClusterConfig
from orchestrator.launcher import LocalCluster
from workers.discovery import InMemoryDiscovery


class FakeSupervisor:
    """Start takes `start_s`; run renews until stopped (what WorkerSupervisor.run does), recording when it began."""

    def __init__(self, name: str, start_s: float, fail: bool = False) -> None:
        self.name, self.start_s, self.fail = name, start_s, fail
        self.run_began: float | None = None
        self.shut_down = False
        self._stop = asyncio.Event()

    async def start(self) -> None:
        await asyncio.sleep(self.start_s)
        if self.fail:
            raise RuntimeError(f"{self.name}: engine exited")

    async def run(self) -> int:
        self.run_began = asyncio.get_running_loop().time()
        await self._stop.wait()
        self.shut_down = True
        return 0

    def request_stop(self) -> None:
        self._stop.set()

    async def shutdown(self, drain: bool = True) -> None:
        self.shut_down = True


def _cluster(tmp_path, sups: list[FakeSupervisor]) -> LocalCluster:
    cluster = LocalCluster(ClusterConfig(workers=len(sups), backend="sim", log_dir=tmp_path), InMemoryDiscovery())
    it = iter(sups)
    cluster.make_supervisor = lambda i, role, tok: next(it)
    return cluster


async def test_a_fast_worker_renews_its_lease_while_a_slow_one_starts(tmp_path) -> None:
    fast, slow = FakeSupervisor("fast", 0.01), FakeSupervisor("slow", 0.5)
    cluster = _cluster(tmp_path, [fast, slow])
    t0 = asyncio.get_running_loop().time()
    await cluster.start()
    assert fast.run_began is not None and fast.run_began - t0 < 0.45  # renewing before the slow one was up (0.5 s)
    assert slow.run_began is not None and slow.run_began - t0 >= 0.5
    assert [s.name for s, _ in cluster.running()] == ["fast", "slow"]
    await cluster.stop()
    assert fast.shut_down and slow.shut_down
    assert cluster.running() == []


async def test_a_failed_start_stops_the_workers_already_running(tmp_path) -> None:
    ok, bad = FakeSupervisor("ok", 0.01), FakeSupervisor("bad", 0.2, fail=True)
    cluster = _cluster(tmp_path, [ok, bad])
    with pytest.raises(RuntimeError, match="bad: engine exited"):
        await cluster.start()
    assert ok.run_began is not None and ok.shut_down  # stopped through its run loop
    assert bad.run_began is None and bad.shut_down  # never ran: shut down directly


def test_engines_get_the_clusters_cpu_list(tmp_path) -> None:
    cluster = LocalCluster(ClusterConfig(workers=2, backend="sim", engine_cpus="1,3-4", log_dir=tmp_path), InMemoryDiscovery())
    assert cluster._engine_cfg(0).cpus == frozenset({1, 3, 4})
    assert LocalCluster(ClusterConfig(workers=1, log_dir=tmp_path), InMemoryDiscovery())._engine_cfg(0).cpus is None
    with pytest.raises(ValidationError, match="engine_cpus"):
        ClusterConfig(engine_cpus="1-")


def test_loose_nixl_engines_on_a_cpu_host_are_flagged(tmp_path) -> None:
    from workers.vllm.backend import VllmBackend

    def cluster(**kw) -> LocalCluster:
        c = LocalCluster(ClusterConfig(backend="vllm", model="m", log_dir=tmp_path, **kw), InMemoryDiscovery())
        c.backend = VllmBackend(device="cpu")
        return c

    assert cluster(prefill_workers=1, decode_workers=1).nixl_on_shared_cpus()
    assert not cluster(prefill_workers=1, decode_workers=1, engine_cpus="1").nixl_on_shared_cpus()
    assert not cluster(workers=2).nixl_on_shared_cpus()  # aggregated: no NIXL


def test_vllm_engines_export_traces_where_the_frontend_does(tmp_path):
    from orchestrator.launcher import engine_config

    on = {"telemetry": {"tracing": {"enabled": True, "endpoint": "http://tempo:4317"}}}
    cfg = engine_config(ClusterConfig(backend="vllm", model="m", log_dir=tmp_path, frontend=on), 8100, None, None)
    assert cfg.extra_args[:2] == ["--otlp-traces-endpoint", "http://tempo:4317"]
    assert cfg.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    off = engine_config(ClusterConfig(backend="vllm", model="m", log_dir=tmp_path), 8100, None, None)
    assert "--otlp-traces-endpoint" not in off.extra_args
    sim = engine_config(ClusterConfig(backend="sim", log_dir=tmp_path, frontend=on), 8100, None, None)
    assert "--otlp-traces-endpoint" not in sim.extra_args  # the sim does not trace
