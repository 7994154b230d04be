"""The admin targets API (orchestrator/routes/admin.py): bearer auth, validation, versioning, OpenAI-style errors."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from orchestrator.routes import make_admin_router
from planner.telemetry import InMemoryTargetsStore, InMemoryTelemetryStore

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
BODY = {"pools": [{"model": "m", "role": "prefill", "ttft_p90_ms": 400, "min_replicas": 1, "max_replicas": 4}], "gpu_budget": 8}


def client(token: str | None = TOKEN) -> httpx.AsyncClient:
    app = FastAPI()
    tel = InMemoryTelemetryStore()
    app.include_router(make_admin_router(InMemoryTargetsStore(), token, tel))
    app.state.tel = tel
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {TOKEN}"}])
async def test_auth_required(headers):
    async with client() as c:
        for method, path in (("GET", "/admin/targets"), ("PUT", "/admin/targets"), ("GET", "/admin/targets/history")):
            r = await c.request(method, path, headers=headers, json=BODY)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"


async def test_disabled_without_token():
    async with client(token=None) as c:
        r = await c.get("/admin/targets", headers=AUTH)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


async def test_put_get_history_and_versions():
    async with client() as c:
        assert (await c.get("/admin/targets", headers=AUTH)).status_code == 404
        r = await c.put("/admin/targets", headers={**AUTH, "if-match": "0"}, json=BODY)
        assert r.status_code == 200 and r.json()["version"] == 1
        r = await c.put("/admin/targets", headers=AUTH, json={**BODY, "gpu_budget": 16})
        assert r.json()["version"] == 2
        got = (await c.get("/admin/targets", headers=AUTH)).json()
        assert got["version"] == 2 and got["targets"]["gpu_budget"] == 16
        hist = (await c.get("/admin/targets/history?limit=5", headers=AUTH)).json()["data"]
        assert [h["version"] for h in hist] == [2, 1]


@pytest.mark.parametrize("body,param", [
    ({"pools": [{"model": "m", "ttft_p90_ms": 0}]}, "pools.0.ttft_p90_ms"),
    ({"pools": [{"model": "m", "min_replicas": 3, "max_replicas": 1}]}, "pools.0"),
    ({"gpu_budget": "lots"}, "gpu_budget"),
])
async def test_bad_targets_refused_clearly(body, param):
    async with client() as c:
        r = await c.put("/admin/targets", headers=AUTH, json=body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == "invalid_targets"
        assert err["message"].startswith("invalid targets: " + param)


async def test_not_json_and_conflict_and_bad_limit():
    async with client() as c:
        r = await c.put("/admin/targets", headers=AUTH, content=b"{oops")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        await c.put("/admin/targets", headers=AUTH, json=BODY)
        r = await c.put("/admin/targets", headers={**AUTH, "if-match": "7"}, json=BODY)
        assert r.status_code == 409 and r.json()["error"]["code"] == "version_conflict"
        r = await c.get("/admin/targets/history?limit=abc", headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


async def test_decisions_listing():
    async with client() as c:
        tel = c._transport.app.state.tel
        await tel.append_decision({"tick": 1, "reason": "hold"})
        r = await c.get("/admin/planner/decisions", headers=AUTH)
        assert r.json()["data"] == [{"tick": 1, "reason": "hold"}]
