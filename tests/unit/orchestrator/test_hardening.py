"""Issue #19, the in-process parts: bad JSON and Unicode, engine-internal fields, the context check, the cheap
prompt bound, admin token and Host/Origin/content-type checks, per-worker metric series, and `kvyard keys`
under concurrency. (Sockets, processes and Redis: tests/integration/test_hostile.py and its neighbours.)"""

from __future__ import annotations

import argparse
import threading
import time

import httpx
import pytest

from orchestrator import keys_cmd
from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.request_fields import ENGINE_INTERNAL, RequestFieldsConfig
from orchestrator.security import load_key_file
from orchestrator.token_cache import ChunkedTokenizer
from orchestrator.tokenizer import PromptTokenizer
from workers.discovery import InMemoryDiscovery

from orchestrator.testing import FakeEngine, winfo

from .test_frontend import assert_openai_error

ADMIN = "admin-token-for-tests-0123456789"
JSON = {"content-type": "application/json"}


@pytest.fixture
async def stack():
    """(client, discovery, app) over a frontend with an admin token; its Host is 127.0.0.1."""
    disc = InMemoryDiscovery()
    app = create_app(FrontendConfig(refresh_interval_s=60, grpc_port=0, security={
        "admin_token": ADMIN, "admin_loopback_reads": True, "request_fields": RequestFieldsConfig(allow=["priority"])}), disc)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=30) as client:
            yield client, disc, app


async def join(app, disc, *infos):
    for i in infos:
        await disc.register(i, ttl_s=60)
    await app.state.pool.refresh()


def requests_counted(app, status: str) -> float:
    return sum(s.value for fam in app.state.metrics.requests.collect() for s in fam.samples
               if s.name.endswith("_total") and s.labels["status"] == status)


# ---- (5) bad JSON and Unicode: 400 in the OpenAI shape, counted ---------------------------------------------------

DEEP = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
NESTED_100 = b'{"model": "m", "prompt": "x", "logit_bias": ' + b'{"a":' * 100 + b"1" + b"}" * 100 + b"}"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", DEEP),
    ("/v1/completions", NESTED_100),
    ("/v1/completions", b'{"model": "m", "prompt": "abc\\ud800def"}'),
    ("/v1/completions", b'{"model": "m", "prompt": ["ok", "\\udfff"]}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
    ("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}'),
])
async def test_bad_json_and_unicode_are_400_and_counted(stack, path, body):
    client, disc, app = stack
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=4096))
        before = requests_counted(app, "400")
        assert_openai_error(await client.post(path, content=body, headers=JSON), 400)
        assert requests_counted(app, "400") == before + 1
        assert not eng.requests


async def test_valid_surrogate_pairs_pass(stack):
    client, disc, app = stack
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=4096))
        r = await client.post("/v1/completions", content=b'{"model": "m", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}', headers=JSON)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [DEEP, b'{"pools": [{"model": "\\ud800", "role": "both"}]}', b"\xff"])
async def test_admin_write_bad_json_is_400_and_counted(stack, body):
    client, _, app = stack
    before = requests_counted(app, "400")
    r = await client.put("/admin/targets", content=body, headers={"authorization": f"Bearer {ADMIN}"})
    assert_openai_error(r, 400)
    assert requests_counted(app, "400") == before + 1


async def test_unmatched_paths_share_one_metric_label(stack):
    client, _, app = stack
    for i in range(5):
        assert_openai_error(await client.get(f"/no/such/path/{i}"), 404)
    labels = {s.labels["endpoint"] for fam in app.state.metrics.requests.collect() for s in fam.samples}
    assert "unmatched" in labels and not any(lbl.startswith("/no/such") for lbl in labels)


def endpoint_counted(app, endpoint: str, status: str) -> float:
    return sum(s.value for fam in app.state.metrics.requests.collect() for s in fam.samples
               if s.name.endswith("_total") and s.labels["endpoint"] == endpoint and s.labels["status"] == status)


def _spy_on(app, path: str) -> tuple[list, list]:
    """(paths the hot route's endpoint served, paths that entered the app's router), from now on."""
    from starlette.routing import request_response

    from orchestrator.routes.openai import _HotRoute

    hot = {r.path: r for r in app.router.routes if isinstance(r, _HotRoute)}
    served, routed = [], []
    endpoint = hot[path].endpoint

    async def spy(request):
        served.append(request.scope["route"].path)
        return await endpoint(request)

    hot[path].endpoint, hot[path].app = spy, request_response(spy)  # the lean chain calls the first, the router the second
    inner = app.router.middleware_stack

    async def counting(scope, receive, send):
        routed.append(scope["path"])
        await inner(scope, receive, send)

    app.router.middleware_stack = counting
    return served, routed


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_inference_posts_take_the_lean_chain_and_keep_their_template(stack, path):
    """The inference POSTs skip the router and FastAPI's own layers (orchestrator/hot_path.py) but not the app's
    middlewares or error handlers: errors still come back in the OpenAI shape, counted under the route template (not
    "unmatched"), a wrong method is a 405 (through the router), and the OpenAPI schema still lists the operation."""
    from orchestrator.routes.openai import _HotRoute

    client, disc, app = stack
    assert isinstance(app.router.routes[0], _HotRoute)
    served, routed = _spy_on(app, path)
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=4096))
        before = endpoint_counted(app, path, "400")
        assert_openai_error(await client.post(path, content=b"{not json", headers=JSON), 400)
        assert endpoint_counted(app, path, "400") == before + 1
        assert served == [path]
        body = {"model": "m", "max_tokens": 2, **({"messages": [{"role": "user", "content": "hi"}]}
                                                   if "chat" in path else {"prompt": "hi"})}
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        assert served == [path, path]
        refused = await client.post(path, json=body, headers={"host": "attacker.example"})  # the app's middleware
        assert_openai_error(refused, 403)
        assert served == [path, path] and routed == []
    assert_openai_error(await client.get(path), 405)
    assert endpoint_counted(app, path, "405") == 1
    assert routed == [path]
    assert path in app.openapi()["paths"]


async def test_inference_post_under_a_root_path_takes_the_full_stack(stack):
    """With a root_path (a proxy's prefix) the router strips it; the lean chain, which matches exact paths, leaves
    such a request to it."""
    client, disc, app = stack
    served, routed = _spy_on(app, "/v1/completions")
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=4096))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path="/api"),
                                     base_url="http://127.0.0.1", timeout=30) as prefixed:
            r = await prefixed.post("/api/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert served == ["/v1/completions"] and routed == ["/api/v1/completions"]


async def test_an_unexpected_error_on_the_lean_chain_is_a_500_in_the_openai_shape(stack):
    """An exception nothing handles is answered by the app's 500 handler, as on the full stack, and raised on to the
    server (which logs it)."""
    from orchestrator.routes.openai import _HotRoute

    client, disc, app = stack
    route = next(r for r in app.router.routes if isinstance(r, _HotRoute) and r.path == "/v1/completions")

    async def broken(request):
        raise ZeroDivisionError("a bug")

    route.endpoint = broken
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://127.0.0.1", timeout=30) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    err = assert_openai_error(r, 500)
    assert "a bug" not in err["message"]


# ---- (6) engine-internal fields never reach the engine --------------------------------------------------------------

async def test_engine_internal_fields_are_stripped(stack):
    client, disc, app = stack
    hostile = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 5600,
                                      "remote_block_ids": [1, 2, 3], "remote_engine_id": "evil"},
               "bootstrap_host": "10.6.6.6", "bootstrap_port": 8998, "bootstrap_room": 42,
               "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": 7},
               "ec_transfer_params": {"x": 1}, "data_parallel_rank": 3, "request_id": "someone-else", "rid": "x"}
    assert set(hostile) <= ENGINE_INTERNAL
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=4096))
        for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = await client.post(path, json={"model": "m", **base, "max_tokens": 2, "top_k": 5, "priority": 1, **hostile})
            assert r.status_code == 200, r.text
            sent = eng.requests[-1]["body"]
            assert not set(sent) & ENGINE_INTERNAL, sent
            assert sent["top_k"] == 5 and sent["priority"] == 1  # allowed, and allowed by the operator
        removed = sum(s.value for fam in app.state.metrics.fields_removed.collect() for s in fam.samples if s.name.endswith("_total"))
        assert removed == 2 * len(hostile)


async def test_unknown_fields_are_refused_by_default(stack):
    client, disc, app = stack
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=4096))
        err = assert_openai_error(await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "chat_template": "{{x}}"}), 400)
        assert err["param"] == "chat_template" and err["code"] == "unknown_parameter"
        assert not eng.requests


def test_engine_internal_fields_cannot_be_allowed():
    with pytest.raises(ValueError, match="kv_transfer_params"):
        RequestFieldsConfig(allow=["kv_transfer_params"])


# ---- (9) the context check uses the smallest context of the model's workers ----------------------------------------

async def test_context_check_uses_the_smallest_worker_context(stack):
    client, disc, app = stack
    with FakeEngine() as big, FakeEngine() as small:
        await join(app, disc, winfo("big", big.url, max_model_len=4096), winfo("small", small.url, max_model_len=256))
        prompt = "hello " * 400  # ~400 tokens: fits 4096, not 256
        err = assert_openai_error(await client.post("/v1/completions", json={"model": "m", "prompt": prompt}), 400)
        assert err["code"] == "context_length_exceeded" and "256" in err["message"]
        r = await client.get("/v1/models")
        assert r.json()["data"][0]["max_model_len"] == 256
        assert not big.requests and not small.requests


# ---- (1) the cheap bound refuses a huge prompt without tokenizing it -------------------------------------------------

def spy_tokenizing(monkeypatch, record) -> None:
    """Call record() wherever a prompt is tokenized: whole (PromptTokenizer) or by cached chunks (ChunkedTokenizer)."""
    for cls in (PromptTokenizer, ChunkedTokenizer):
        real = cls.count_or_ids
        monkeypatch.setattr(cls, "count_or_ids", lambda self, *a, _real=real, **k: record() or _real(self, *a, **k))


async def test_huge_prompt_refused_before_tokenizing(stack, monkeypatch):
    client, disc, app = stack
    calls = []
    spy_tokenizing(monkeypatch, lambda: calls.append(1))
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=64))  # 64 tokens x 128 characters at most
        t0 = time.perf_counter()
        err = assert_openai_error(await client.post("/v1/completions", json={"model": "m", "prompt": "a" * 2_000_000}), 400)
        assert err["code"] == "context_length_exceeded" and "2000000 characters" in err["message"]
        assert calls == [] and time.perf_counter() - t0 < 5
        # under the bound but over the context: tokenized, then refused with its token count
        err = assert_openai_error(await client.post("/v1/completions", json={"model": "m", "prompt": "word " * 1000}), 400)
        assert "has 1001 tokens" in err["message"] and calls


async def test_long_prompts_are_tokenized_off_the_loop(stack, monkeypatch):
    client, disc, app = stack
    threads = []
    spy_tokenizing(monkeypatch, lambda: threads.append(threading.current_thread().name))
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=8192))
        for text in ("short prompt", "abcdefgh " * 2500):
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
            assert r.status_code == 200, r.text
    assert threads[0] == threading.main_thread().name and len(threads) > 1
    assert all(name.startswith("kvyard-prep") for name in threads[1:]), threads


# ---- (7) admin token from everyone, Host/Origin, JSON only -----------------------------------------------------------

async def test_admin_token_required_from_loopback_too(stack):
    client, _, _ = stack
    for path in ("/api/cluster", "/api/pools", "/admin/targets/history"):
        assert_openai_error(await client.get(path), 401)  # loopback client, no token: refused once a token is set
        assert_openai_error(await client.get(path, headers={"authorization": "Bearer wrong"}), 401)
        assert (await client.get(path, headers={"authorization": f"Bearer {ADMIN}"})).status_code == 200


async def test_host_and_origin_checked_on_admin_and_writes(stack):
    client, disc, app = stack
    auth = {"authorization": f"Bearer {ADMIN}"}
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=4096))
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        rebind = {"host": "attacker.example:8000"}
        assert assert_openai_error(await client.get("/api/cluster", headers={**auth, **rebind}), 403)["code"] == "host_not_allowed"
        assert_openai_error(await client.post("/v1/completions", json=body, headers=rebind), 403)
        assert (await client.get("/health", headers=rebind)).status_code == 200  # probes are not host-checked
        cross = {"origin": "http://attacker.example"}
        assert assert_openai_error(await client.post("/v1/completions", json=body, headers=cross), 403)["code"] == "origin_not_allowed"
        assert_openai_error(await client.get("/api/cluster", headers={**auth, "origin": "null"}), 403)
        same = {"origin": "http://127.0.0.1"}
        assert (await client.post("/v1/completions", json=body, headers=same)).status_code == 200
        assert (await client.get("/api/cluster", headers={**auth, "host": "localhost:8000", "origin": "http://localhost:8000"})).status_code == 200
        assert len(eng.requests) == 1


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
async def test_inference_needs_a_json_content_type(stack, ctype):
    client, disc, app = stack
    with FakeEngine() as eng:
        await join(app, disc, winfo("a", eng.url, max_model_len=4096))
        headers = {"content-type": ctype} if ctype else {}
        r = await client.post("/v1/completions", content=b'{"model": "m", "prompt": "hi", "max_tokens": 2}', headers=headers)
        assert assert_openai_error(r, 415)["code"] == "unsupported_media_type"
        r = await client.post("/v1/completions", content=b'{"model": "m", "prompt": "hi", "max_tokens": 2}',
                              headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200
        assert len(eng.requests) == 1


# ---- (9) per-worker metric series go when the worker goes ------------------------------------------------------------

async def test_worker_series_removed_when_it_leaves(stack):
    client, disc, app = stack
    with FakeEngine() as a, FakeEngine() as b:
        await join(app, disc, winfo("wa", a.url, max_model_len=4096), winfo("wb", b.url, max_model_len=4096))
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})).status_code == 200
        # The router's random tie-break may send all four to one worker: give both a breaker series, so each has
        # at least one per-worker series whatever the routing did.
        for w in ("wa", "wb"):
            app.state.service.breakers.failure(w, "test")
            app.state.service._breaker_changed(w, app.state.service.breakers.state(w))
        text = (await client.get("/metrics")).text
        assert 'worker="wa"' in text and 'worker="wb"' in text
        await disc.deregister("wa")
        await app.state.pool.refresh()
        text = (await client.get("/metrics")).text
        assert 'worker="wa"' not in text and 'worker="wb"' in text, [l for l in text.splitlines() if 'worker="wa"' in l]


# ---- (9) `kvyard keys` under concurrency ---------------------------------------------------------------------------

def _slow_saves(monkeypatch, delay_s: float = 0.2):
    real = keys_cmd.save_key_file

    def slow(path, kf):
        time.sleep(delay_s)  # widen the read-modify-write window
        real(path, kf)

    monkeypatch.setattr(keys_cmd, "save_key_file", slow)


def _cmd(command: str, path, **kw) -> argparse.Namespace:
    base = {"keys_command": command, "file": path, "name": "", "rpm": None, "tpm": None, "priority": "normal", "weight": 1.0}
    return argparse.Namespace(**{**base, **kw})


def test_concurrent_key_creates_lose_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "keys.yaml"
    _slow_saves(monkeypatch)
    threads = [threading.Thread(target=keys_cmd.run_keys_command, args=(_cmd("create", path, name=f"k{i}"),)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(k.name for k in load_key_file(path).keys) == [f"k{i}" for i in range(6)]


def test_a_concurrent_create_does_not_undo_a_revoke(tmp_path, monkeypatch, capsys):
    path = tmp_path / "keys.yaml"
    assert keys_cmd.run_keys_command(_cmd("create", path, name="victim")) == 0
    kid = load_key_file(path).keys[0].id
    _slow_saves(monkeypatch)
    create = threading.Thread(target=keys_cmd.run_keys_command, args=(_cmd("create", path, name="other"),))
    create.start()
    time.sleep(0.05)  # the create has read the file and is about to write it
    assert keys_cmd.run_keys_command(_cmd("revoke", path, key_id=kid)) == 0
    create.join()
    keys = {k.name: k for k in load_key_file(path).keys}
    assert keys["victim"].revoked_at is not None and "other" in keys
