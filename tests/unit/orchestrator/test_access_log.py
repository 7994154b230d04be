"""The access log: one line per inference request, text or JSON, with status, worker, tokens and times, redacted."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.security import register_secret
from orchestrator.testing import FakeEngine, winfo
from workers.discovery import InMemoryDiscovery


async def serve(cfg: FrontendConfig, eng, body: dict, path: str = "/v1/completions", headers: dict | None = None):
    disc = InMemoryDiscovery()
    app = create_app(cfg, disc)
    async with app.router.lifespan_context(app):
        await disc.register(winfo("a", eng.url), ttl_s=60)
        await app.state.pool.refresh()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.post(path, json=body, headers=headers or {})


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvyard.access"]


@pytest.mark.parametrize("stream", [False, True])
async def test_one_json_line_per_request(caplog, stream):
    caplog.set_level(logging.INFO, logger="kvyard.access")
    cfg = FrontendConfig(grpc_port=0, log_requests=True, log_requests_format="json")
    with FakeEngine(tokens=4) as eng:
        r = await serve(cfg, eng, {"model": "m", "prompt": "hello there", "max_tokens": 4, "stream": stream,
                                   "stream_options": {"include_usage": True} if stream else None} if stream else
                        {"model": "m", "prompt": "hello there", "max_tokens": 4})
    assert r.status_code == 200
    lines = access_lines(caplog)
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["request_id"] == r.headers["x-request-id"] and rec["status"] == 200 and rec["worker"] == "a"
    assert rec["path"] == "/v1/completions" and rec["model"] == "m" and rec["prompt_tokens"] > 0
    assert rec["output_tokens"] == 4 and "cached_tokens" in rec and rec["queue_s"] >= 0
    assert 0 < rec["total_s"] < 30
    if stream:
        assert 0 < rec["ttft_s"] <= rec["total_s"]
    else:
        assert "ttft_s" not in rec


async def test_text_lines_errors_and_redaction(caplog):
    caplog.set_level(logging.INFO, logger="kvyard.access")
    secret = "sk-kvyard-access-log-secret-0123456789"
    register_secret(secret)
    cfg = FrontendConfig(grpc_port=0, log_requests=True)
    with FakeEngine() as eng:
        r = await serve(cfg, eng, {"model": "nope", "prompt": "x"}, headers={"x-request-id": secret})
    assert r.status_code == 404
    (line,) = access_lines(caplog)
    assert "status=404" in line and "path=/v1/completions" in line and secret not in line


async def test_off_by_default(caplog):
    caplog.set_level(logging.INFO, logger="kvyard.access")
    with FakeEngine() as eng:
        r = await serve(FrontendConfig(grpc_port=0), eng, {"model": "m", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and access_lines(caplog) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_response_logs_its_tokens(caplog, stream):
    from orchestrator.testing.sim_thread import ThreadedSim

    caplog.set_level(logging.INFO, logger="kvyard.access")
    cfg = FrontendConfig(grpc_port=0, log_requests=True, log_requests_format="json")
    with ThreadedSim() as sim:
        disc = InMemoryDiscovery()
        app = create_app(cfg, disc)
        async with app.router.lifespan_context(app):
            await disc.register(sim.info("g1"), ttl_s=60)
            await app.state.pool.refresh()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
                r = await client.post("/v1/responses", json={"model": "m", "input": "hello", "max_output_tokens": 5, "stream": stream})
                assert r.status_code == 200
    (line,) = access_lines(caplog)
    rec = json.loads(line)
    assert rec["path"] == "/v1/responses" and rec["worker"] == "g1" and rec["output_tokens"] == 5 and rec["prompt_tokens"] > 0
    assert ("ttft_s" in rec) is stream
