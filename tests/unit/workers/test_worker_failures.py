"""Worker failure reports (WorkerFailure in discovery, shown on /api/cluster) and the backend-related config."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from orchestrator.cli import build_parser, worker_config
from orchestrator.config import ClusterConfig
from workers.discovery import InMemoryDiscovery
from workers.process import EngineStartError
from workers.registry import get_backend
from workers.types import EngineLaunchConfig, WorkerFailure
from workers.worker import WorkerOptions, WorkerSupervisor


async def test_in_memory_failures_newest_first_and_expire() -> None:
    d = InMemoryDiscovery()
    await d.report_failure(WorkerFailure(worker_id="a", backend="sglang", model="m", error="x", at=1.0))
    await d.report_failure(WorkerFailure(worker_id="b", backend="trtllm", model="m", error="y", at=2.0))
    await d.report_failure(WorkerFailure(worker_id="c", backend="vllm", model="m", error="z", at=3.0), ttl_s=-1)
    assert [f.worker_id for f in await d.list_failures()] == ["b", "a"]


async def test_supervisor_reports_an_engine_that_exits_while_starting(tmp_path) -> None:
    d = InMemoryDiscovery()
    cfg = EngineLaunchConfig(model="m", served_model_name="m", port=1, kv_events_endpoint=None,
                             engine_cmd=[sys.executable, "-c", "print('out of memory'); raise SystemExit(7)"])
    sup = WorkerSupervisor(get_backend("sglang"), cfg, d, WorkerOptions(worker_id="w1", log_path=str(tmp_path / "e.log"),
                                                                        start_timeout_s=30))
    with pytest.raises(EngineStartError, match="exited with code 7"):
        await sup.start()
    (f,) = await d.list_failures()
    assert (f.worker_id, f.backend, f.phase) == ("w1", "sglang", "start") and "out of memory" in f.error
    assert await d.list_workers() == []
    await sup.shutdown(drain=False)


async def test_supervisor_reports_a_program_that_does_not_exist() -> None:
    d = InMemoryDiscovery()
    cfg = EngineLaunchConfig(model="m", served_model_name="m", port=1, engine_cmd=["/nonexistent/trtllm-serve"])
    sup = WorkerSupervisor(get_backend("trtllm"), cfg, d, WorkerOptions(worker_id="w2"))
    with pytest.raises(EngineStartError, match="cannot start the trtllm engine"):
        await sup.start()
    assert [f.worker_id for f in await d.list_failures()] == ["w2"]


def test_flavor_defaults_to_the_backends_own() -> None:
    assert ClusterConfig(backend="sim").flavor == "vllm" and ClusterConfig(backend="sim", flavor="trtllm").flavor == "trtllm"
    assert ClusterConfig(backend="sglang").flavor == "sglang" and ClusterConfig(backend="trtllm").flavor == "trtllm"
    with pytest.raises(ValidationError, match="speaks its own P/D hand-off"):
        ClusterConfig(backend="sglang", flavor="vllm")
    with pytest.raises(ValidationError):
        ClusterConfig(backend="tgi")


def test_cli_accepts_every_backend_and_an_engine_command() -> None:
    p = build_parser()
    for backend in ("sim", "vllm", "sglang", "trtllm"):
        ns = p.parse_args(["worker", "--backend", backend, "--model", "m", "--served-model-name", "m",
                           "--engine-cmd", "python -m workers.sim --flavor sglang", "--tokenizer", "/tok"])
        cfg = worker_config(ns, environ={})
        assert cfg.engine_cmd == ["python", "-m", "workers.sim", "--flavor", "sglang"] and cfg.tokenizer == "/tok"
        assert p.parse_args(["up", "--backend", backend]).backend == backend
    env = {"KVYARD_ENGINE_CMD": "python -m workers.sim"}
    assert worker_config(p.parse_args(["worker"]), environ=env).engine_cmd == ["python", "-m", "workers.sim"]
    assert worker_config(p.parse_args(["worker", "--engine-cmd", ""]), environ={}).engine_cmd is None
    with pytest.raises(ValidationError, match="engine_cmd"):
        worker_config(p.parse_args(["worker", "--engine-cmd", "python -c 'unterminated"]), environ={})
