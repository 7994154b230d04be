"""The frontend's doors over HTTP, in process (httpx ASGITransport) against a fake engine: API keys,
per-key rate limits, the admin token on every operator surface, engine internals never reachable,
and no credential in any log line."""

from __future__ import annotations

import logging

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.security import KeyFile, generate_key, redact, save_key_file
from workers.discovery import InMemoryDiscovery

from orchestrator.testing import FakeEngine, winfo

ADMIN = "admin-" + "z" * 30
BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


def make_keys(tmp_path, **limits):
    """(path, {name: key}) for keys 'open' (no limits), 'limited' (limits) and 'revoked'."""
    keys, records = {}, []
    for name, lim in (("open", {}), ("limited", limits), ("revoked", {})):
        key, rec = generate_key(name, **lim)
        if name == "revoked":
            rec.revoked_at = 1.0
        keys[name] = key
        records.append(rec)
    path = tmp_path / "keys.yaml"
    save_key_file(path, KeyFile(keys=records))
    return path, keys


class Stack:
    def __init__(self, app, client: httpx.AsyncClient, disc: InMemoryDiscovery) -> None:
        self.app, self.client, self.disc = app, client, disc

    async def add(self, *infos) -> None:
        for i in infos:
            await self.disc.register(i, ttl_s=60)
        await self.app.state.pool.refresh()


async def _stack(cfg: FrontendConfig, client_addr=("127.0.0.1", 5000)):
    disc = InMemoryDiscovery()
    app = create_app(cfg, disc)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=client_addr)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield Stack(app, client, disc)


@pytest.fixture
async def keyed(tmp_path):
    path, keys = make_keys(tmp_path, rpm=3)
    async for s in _stack(FrontendConfig(refresh_interval_s=60, grpc_port=0, security={"api_keys_file": path, "admin_token": ADMIN})):
        s.keys = keys
        yield s


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"]
    return err


async def test_inference_needs_a_valid_key(keyed):
    c = keyed.client
    with FakeEngine() as eng:
        await keyed.add(winfo("a", eng.url))
        err = openai_error(await c.post("/v1/completions", json=BODY), 401, "invalid_api_key")
        assert err["type"] == "authentication_error" and "Authorization: Bearer" in err["message"]
        for headers in (bearer("kvy_0123456789ab_" + "x" * 43), bearer(keyed.keys["open"] + "x"), {"authorization": keyed.keys["open"]},
                        {"authorization": f"Basic {keyed.keys['open']}"}, bearer(ADMIN), {"x-api-key": "nope"}):
            openai_error(await c.post("/v1/completions", json=BODY, headers=headers), 401, "invalid_api_key")
        err = openai_error(await c.post("/v1/chat/completions", json=BODY, headers=bearer(keyed.keys["revoked"])), 401, "invalid_api_key")
        assert "revoked" in err["message"]
        assert eng.requests == []  # nothing refused reached the engine
        r = await c.post("/v1/completions", json=BODY, headers=bearer(keyed.keys["open"]))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                         headers={"x-api-key": keyed.keys["open"]})
        assert r.status_code == 200
        assert "authorization" not in eng.requests[0]["headers"] and "x-api-key" not in eng.requests[1]["headers"]  # keys stay here
        openai_error(await c.get("/v1/models"), 401, "invalid_api_key")
        assert (await c.get("/v1/models", headers=bearer(keyed.keys["open"]))).json()["data"][0]["id"] == "m"
        for path in ("/live", "/metrics"):  # probes and scraping stay open
            assert (await c.get(path)).status_code == 200
        assert (await c.get("/health")).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert 'kvyard_auth_failures_total{reason="missing",surface="http"}' in metrics
        assert 'kvyard_auth_failures_total{reason="revoked",surface="http"} 1.0' in metrics


async def test_rate_limit_per_key_is_openai_429(keyed):
    c = keyed.client
    with FakeEngine() as eng:
        await keyed.add(winfo("a", eng.url))
        limited = bearer(keyed.keys["limited"])
        for i in range(3):
            r = await c.post("/v1/completions", json=BODY, headers=limited)
            assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == str(2 - i)
            assert r.headers["x-ratelimit-limit-requests"] == "3"
        r = await c.post("/v1/completions", json={**BODY, "stream": True}, headers=limited)
        err = openai_error(r, 429, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_error" and "requests per minute" in err["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 20 and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert len(eng.requests) == 3
        assert (await c.post("/v1/completions", json=BODY, headers=bearer(keyed.keys["open"]))).status_code == 200  # others unaffected
        assert 'kvyard_rate_limited_total{key_id="' in (await c.get("/metrics")).text


async def test_tokens_per_minute_counts_prompt_and_max_tokens(tmp_path):
    path, keys = make_keys(tmp_path, tpm=100)
    async for s in _stack(FrontendConfig(refresh_interval_s=60, max_body_bytes=4096, grpc_port=0, security={"api_keys_file": path})):
        with FakeEngine() as eng:
            await s.add(winfo("a", eng.url))
            h = bearer(keys["limited"])
            r = await s.client.post("/v1/completions", json={**BODY, "max_tokens": 60}, headers=h)  # 2 + 60 of 100
            assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == "38"
            assert r.json()["choices"][0]["text"] == "xxxxx"  # the body read for the estimate still reached the engine
            r = await s.client.post("/v1/completions", json={**BODY, "max_tokens": 60, "stream": True}, headers=h)  # into debt
            assert r.status_code == 200 and "[DONE]" in r.text
            err = openai_error(await s.client.post("/v1/completions", json=BODY, headers=h), 429, "rate_limit_exceeded")
            assert "tokens per minute" in err["message"]
            r = await s.client.post("/v1/completions", content=b"x" * 5000, headers={**h, "content-type": "application/json"})  # the bounded read still says 413
            openai_error(r, 413, "payload_too_large")


@pytest.mark.parametrize("path", ["/api/pools", "/api/cluster", "/admin/targets", "/admin/targets/history", "/admin/planner/decisions"])
async def test_admin_reads_need_the_admin_token(keyed, path):
    c = keyed.client
    openai_error(await c.get(path), 401, "invalid_admin_token")
    openai_error(await c.get(path, headers=bearer("not-it")), 401, "invalid_admin_token")
    openai_error(await c.get(path, headers=bearer(keyed.keys["open"])), 401, "invalid_admin_token")  # an API key is not admin
    r = await c.get(path, headers=bearer(ADMIN))
    assert r.status_code in (200, 404), r.text  # 404: no targets set yet
    assert ADMIN not in r.text


async def test_without_admin_token_admin_is_off_except_local_reads(tmp_path):
    cfg = FrontendConfig(refresh_interval_s=60, grpc_port=0)  # 127.0.0.1 and no token: loopback reads only
    async for s in _stack(cfg, client_addr=("10.1.2.3", 4000)):  # a remote client
        for path in ("/dashboard", "/api/pools", "/api/cluster", "/admin/targets"):
            openai_error(await s.client.get(path), 403, "admin_disabled")
        openai_error(await s.client.put("/admin/targets", json={"pools": []}, headers=bearer("x")), 403, "admin_disabled")
    async for s in _stack(cfg):  # a loopback client
        assert (await s.client.get("/dashboard")).status_code == 200
        assert (await s.client.get("/api/cluster")).status_code == 200
        assert (await s.client.get("/api/pools")).status_code == 200
        err = openai_error(await s.client.put("/admin/targets", json={"pools": []}), 403, "admin_disabled")
        assert "KVYARD_ADMIN_TOKEN" in err["message"]
    async for s in _stack(FrontendConfig(host="0.0.0.0", refresh_interval_s=60, grpc_port=0)):  # listening beyond loopback: nothing
        openai_error(await s.client.get("/api/pools"), 403, "admin_disabled")


async def test_dashboard_page_is_a_shell_that_sends_the_token(keyed):
    r = await keyed.client.get("/dashboard")  # a browser cannot send a bearer header when opening a page
    assert r.status_code == 200 and ADMIN not in r.text
    assert "sessionStorage" in r.text and '"authorization": "Bearer "' in r.text and "#token=" not in r.text.split("<script>")[0]


ENGINE_PATHS = [
    ("GET", "/kv_cache_events"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("POST", "/sleep"),
    ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/pause"), ("POST", "/resume"), ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"), ("GET", "/server_info"),
    ("POST", "/start_profile"), ("POST", "/stop_profile"), ("POST", "/scale_elastic_ep"), ("POST", "/update_weights"),
    ("POST", "/flush_cache"), ("GET", "/get_server_info"), ("POST", "/abort_request"), ("GET", "/v1/responses/a/b"),
    ("DELETE", "/v1/responses/x"),
    ("POST", "/kvyard/continue"), ("GET", "/v1/completions/../../collective_rpc"), ("POST", "/v1/../sleep"),
    ("GET", "/engine/metrics"), ("GET", "/workers/a/metrics"), ("POST", "/v1/completions/extra"), ("GET", "/proxy/http://127.0.0.1/"),
]


@pytest.mark.parametrize("method,path", ENGINE_PATHS)
async def test_engine_internals_are_not_reachable(keyed, method, path):
    c = keyed.client
    with FakeEngine() as eng:
        await keyed.add(winfo("a", eng.url))
        for headers in ({}, bearer(keyed.keys["open"]), bearer(ADMIN)):
            r = await c.request(method, path, headers=headers, json={"model": "m"})
            assert r.status_code in (404, 405), (method, path, r.status_code, r.text)
            assert r.json()["error"]["type"] in ("not_found_error", "invalid_request_error")
        assert eng.requests == []  # the frontend proxied nothing


def test_the_frontend_serves_a_closed_set_of_routes():
    """Every route the app has is named here: a new one must be added on purpose (and guarded)."""
    app = create_app(FrontendConfig(grpc_port=0))
    served = set(app.openapi()["paths"]) | {r.path for r in app.routes if hasattr(r, "path")}  # included routers too
    assert "/api/pools" in served and "/admin/targets" in served
    allowed = {"/", "/v1/completions", "/v1/chat/completions", "/v1/models", "/live", "/health", "/metrics", "/dashboard",
               "/api/cluster", "/api/pools", "/admin/targets", "/admin/targets/history", "/admin/planner/decisions",
               "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
               # forwarded whole to an engine (orchestrator/passthrough.py), authorised like generation
               "/v1/embeddings", "/tokenize", "/detokenize", "/v1/responses", "/v1/responses/{response_id}",
               "/v1/responses/{response_id}/cancel"}
    assert served <= allowed, served - allowed
    # the one path parameter: a response id, checked against RESPONSE_ID before it goes into an engine's URL
    assert {p for p in served if "{" in p} == {"/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"}


def test_the_index_at_root_names_only_served_routes():
    from orchestrator.routes.ops import INDEX

    def paths(node):
        return [node] if isinstance(node, str) else [p for v in node.values() for p in paths(v)]

    app = create_app(FrontendConfig(grpc_port=0))
    served = set(app.openapi()["paths"]) | {r.path for r in app.routes if hasattr(r, "path")}
    named = paths({k: v for k, v in INDEX.items() if k != "service"})
    assert "/v1/embeddings" in named and "/tokenize" in named
    assert set(named) <= served, set(named) - served


async def test_no_credential_reaches_the_logs(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    c = keyed.client
    wrong = keyed.keys["open"][:-4] + "AAAA"  # the right id with a wrong secret
    secret_part = keyed.keys["open"].split("_", 2)[2]
    with FakeEngine() as eng:
        await keyed.add(winfo("a", eng.url))
        await c.post("/v1/completions", json=BODY, headers=bearer(wrong))
        await c.post("/v1/completions", json=BODY, headers=bearer(keyed.keys["revoked"]))
        await c.post("/v1/completions", json=BODY, headers={"x-api-key": "sk-live-plaintext-123456"})
        await c.put("/admin/targets", json={}, headers=bearer(ADMIN[:-1] + "q"))
        await c.post("/v1/completions", json=BODY, headers=bearer(keyed.keys["open"]))
        # code that logs a header by mistake is caught too
        logging.getLogger("kvyard.test").warning("headers %s", {"authorization": f"Bearer {keyed.keys['open']}"})
        logging.getLogger("kvyard.test").warning("admin token is %s", ADMIN)
    text = caplog.text
    assert "refused an API key (invalid" in text and "refused an API key (revoked" in text
    kid = keyed.keys["open"].split("_")[1]
    assert kid in text  # the public id is kept for debugging
    for secret in (secret_part, wrong.split("_", 2)[2], keyed.keys["revoked"].split("_", 2)[2], ADMIN, ADMIN[:-1] + "q"):
        assert secret not in text
    assert "Bearer ***" in text


@pytest.mark.parametrize("line,leak", [
    ("Authorization: Bearer abc.def-ghi", "abc.def-ghi"),
    ("x-api-key=sk-12345678", "sk-12345678"),
    ('{"api_key": "sk-abcdefgh"}', "sk-abcdefgh"),
    ("url https://h/?admin_token=tok123456", "tok123456"),
    ("redis://:pw@h password=hunter22", "hunter22"),
    ("discovery: rediss://default:s3cr3tpw@redis.example:6380/2 unreachable", "s3cr3tpw"),
])
def test_redact_patterns(line, leak):
    out = redact(line)
    assert leak not in out and "***" in out


@pytest.mark.parametrize("method,path", [("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                                         ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
                                         ("POST", "/v1/responses/resp_1/cancel")])
async def test_forwarded_endpoints_need_a_key(keyed, method, path):
    with FakeEngine() as eng:
        await keyed.add(winfo("a", eng.url))
        r = await keyed.client.request(method, path, json={"model": "m", "input": "x"})
        openai_error(r, 401, "invalid_api_key")
        assert eng.requests == []
