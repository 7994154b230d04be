"""One trace from the client through kvyard to a real vLLM-CPU engine.

vLLM runs with `--otlp-traces-endpoint` and the frontend with tracing on; both export over OTLP/gRPC to a
receiver this test runs on 127.0.0.1 (orchestrator/testing/otlp_receiver.py). One chat request carrying the
client's traceparent must give one trace id across both services: the frontend's SERVER span under the client's
span, its engine-attempt span under that, and vLLM's `llm_request` span under the attempt.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.testing.otlp_receiver import OtlpReceiver
from tests.integration.conftest import build_tiny_model, free_port, vllm_python_or_fail
from workers.discovery import InMemoryDiscovery
from workers.process import EngineProcess
from workers.registry import get_backend
from workers.types import EngineLaunchConfig, WorkerInfo

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODEL = "tiny"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced_engine():
    python = vllm_python_or_fail()
    model = build_tiny_model(python)
    work = Path(tempfile.mkdtemp(prefix="kvy-trace-"))
    with OtlpReceiver() as rx:
        cfg = EngineLaunchConfig(model=str(model), python=python, served_model_name=MODEL, port=free_port(), block_size=32,
                                 max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048,
                                 extra_args=["--otlp-traces-endpoint", rx.endpoint])
        proc = EngineProcess(get_backend("vllm"), cfg, log_path=work / "engine.log")
        try:
            proc.start()
            asyncio.run(proc.wait_healthy(timeout=300))
            yield proc.url, rx
        finally:
            asyncio.run(proc.stop())


async def test_one_trace_across_frontend_and_vllm(traced_engine):
    url, rx = traced_engine
    cfg = FrontendConfig(grpc_port=0, refresh_interval_s=60, scrape_interval_s=60,
                         telemetry={"tracing": {"enabled": True, "endpoint": rx.endpoint, "service_name": "kvyard-frontend"}})
    disc = InMemoryDiscovery()
    await disc.register(WorkerInfo(worker_id="v1", model=MODEL, backend="vllm", url=url, block_size=32, max_model_len=512), ttl_s=60)
    app = create_app(cfg, disc)
    async with app.router.lifespan_context(app):  # on exit the frontend's spans are flushed
        await app.state.pool.refresh()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120) as client:
            r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                                                                 "max_tokens": 4},
                                  headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            assert r.status_code == 200, r.text

    def both(spans) -> bool:
        mine = [s for s in spans if s.trace_id == CLIENT_TRACE]
        return any(s.name == "llm_request" for s in mine) and any(s.service == "kvyard-frontend" for s in mine)

    spans = [s for s in await asyncio.to_thread(rx.wait_for, both, 60.0) if s.trace_id == CLIENT_TRACE]
    names = {s.name: s for s in spans}
    assert "POST /v1/chat/completions" in names and "llm_request" in names, [(s.service, s.name) for s in spans]
    server, engine = names["POST /v1/chat/completions"], names["llm_request"]
    attempt = names["kvyard.engine_attempt"]
    assert server.service == "kvyard-frontend" and server.parent_span_id == CLIENT_SPAN
    assert attempt.parent_span_id == server.span_id and attempt.attributes["kvyard.worker"] == "v1"
    assert engine.service != "kvyard-frontend" and engine.parent_span_id == attempt.span_id  # vLLM's span, joined
    assert {"kvyard.tokenize", "kvyard.admission", "kvyard.route"} <= set(names)
