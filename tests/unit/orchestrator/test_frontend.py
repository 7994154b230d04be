"""The frontend against scriptable fake engines: OpenAI errors, streaming relay, failover."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from workers.discovery import InMemoryDiscovery
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from orchestrator.testing import FakeEngine, ThreadedEngine, free_port, winfo
from orchestrator.testing.frontend_client import TRANSPORTS, frontend_client
from workers.sim.backend import SIM_TOKENIZER_DIR as TOKENIZER_DIR


@pytest.fixture(params=TRANSPORTS)
async def frontend(request):
    """Yields (client, discovery); register workers in discovery, then call `await refresh()`. Over ASGI and over
    kvyard's HTTP server (where streams take the direct, callback path)."""
    disc = InMemoryDiscovery()
    cfg = FrontendConfig(max_body_bytes=4096, refresh_interval_s=0.05, grpc_port=0, resilience={"retry_after_s": 2})
    app = create_app(cfg, disc)
    async with frontend_client(app, cfg, request.param) as client:
        client.refresh = app.state.pool.refresh
        client.app = app
        yield client, disc


async def add(disc, client, *infos):
    for i in infos:
        await disc.register(i, ttl_s=60)
    await client.refresh()


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


async def test_completion_passthrough(frontend):
    client, disc = frontend
    with FakeEngine() as eng:
        await add(disc, client, winfo("a", eng.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["x-kvyard-worker"] == "a"
        assert eng.requests[0]["headers"]["x-request-id"] == r.headers["x-request-id"]


@pytest.mark.parametrize("include_usage", [False, True])
async def test_stream_usage_chunk_only_when_asked(frontend, include_usage):
    client, disc = frontend
    with FakeEngine(tokens=4) as eng:
        await add(disc, client, winfo("a", eng.url))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        usage = [e for e in events if '"usage"' in e]
        assert len(usage) == (1 if include_usage else 0)
        assert len(events) == 4 + 1 + len(usage)
        # the engine was always asked for usage, so the frontend can count tokens
        assert eng.requests[0]["body"]["stream_options"]["include_usage"] is True


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1,2]", 400, None),
        (json.dumps({"prompt": "x"}).encode(), 400, "model"),
        (json.dumps({"model": "m"}).encode(), 400, "prompt"),
        (json.dumps({"model": "m", "prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "m", "prompt": "x", "max_tokens": 10**9}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "m", "prompt": "x", "n": 0}).encode(), 400, "n"),
        (json.dumps({"model": "m", "prompt": "word " * 200}).encode(), 400, "prompt"),  # > 64-token context
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"model": "m", "prompt": "x" * 5000}).encode(), 413, None),
    ],
)
async def test_bad_input_gets_openai_error(frontend, body, status, param):
    client, disc = frontend
    with FakeEngine() as eng:
        await add(disc, client, winfo("a", eng.url))
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        err = assert_openai_error(r, status)
        if param:
            assert err["param"] == param
        assert not eng.requests  # refused before reaching any engine


async def test_chat_bad_messages(frontend):
    client, disc = frontend
    with FakeEngine() as eng:
        await add(disc, client, winfo("a", eng.url))
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert_openai_error(r, 400)
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
        assert_openai_error(r, 400)


async def test_no_ready_worker_is_503_with_retry_after(frontend):
    client, disc = frontend
    from workers.types import WorkerState

    await add(disc, client, winfo("a", "http://127.0.0.1:9"))
    await disc.set_state("a", WorkerState.DRAINING)
    await client.refresh()
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert_openai_error(r, 503)
    assert r.headers["retry-after"] == "2"


async def test_failover_to_next_worker_on_connection_refused(frontend):
    client, disc = frontend
    with FakeEngine() as eng:
        dead = f"http://127.0.0.1:{free_port()}"
        await add(disc, client, winfo("a-dead", dead), winfo("b-live", eng.url))
        for _ in range(4):  # round-robin puts the dead one first every other request
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-kvyard-worker"] == "b-live"


async def test_engine_500_retried_elsewhere_then_503(frontend):
    client, disc = frontend
    with FakeEngine(fail_status=500) as bad, FakeEngine() as good:
        await add(disc, client, winfo("a", bad.url), winfo("b", good.url))
        for _ in range(2):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200
        await disc.deregister("b")
        await client.refresh()
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert_openai_error(r, 503)


async def test_engine_client_error_passed_through(frontend):
    client, disc = frontend
    with FakeEngine(fail_status=400) as eng:
        await add(disc, client, winfo("a", eng.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "boom"


async def test_stream_broken_mid_way_ends_with_error_event(frontend):
    client, disc = frontend
    with FakeEngine(tokens=6, break_after=2) as eng:
        await add(disc, client, winfo("a", eng.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2]


async def test_router_load_released_on_every_path(frontend):
    client, disc = frontend
    with FakeEngine() as eng:
        await add(disc, client, winfo("a", eng.url))
        await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10**6})
    app_router = client.app.state.router
    assert app_router.loads.load("a").inflight_requests == 0
    assert app_router.loads.load("a").prefill_tokens == 0


async def test_models_health_metrics(frontend):
    client, disc = frontend
    r = await client.get("/health")
    assert r.status_code == 503
    with FakeEngine() as eng:
        await add(disc, client, winfo("a", eng.url))
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        text = (await client.get("/metrics")).text
        for name in ("kvyard_time_to_first_token_seconds", "kvyard_inter_token_latency_seconds", "kvyard_input_sequence_tokens",
                     "kvyard_output_sequence_tokens", "kvyard_inflight_requests", "kvyard_requests_total"):
            assert name in text
    r = await client.get("/nope")
    assert_openai_error(r, 404)


async def test_tokenizer_fetched_from_discovery_when_path_unreadable(frontend, tmp_path):
    client, disc = frontend
    files = {n: (TOKENIZER_DIR / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")}
    await disc.publish_files("m", files)
    info = winfo("a", "http://127.0.0.1:9").model_copy(update={"tokenizer": "/nonexistent/on/this/host"})
    with FakeEngine() as eng:
        await add(disc, client, info.model_copy(update={"url": eng.url}))
        # the length check needs token ids, so a 400 proves the fetched tokenizer is in use
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "word " * 200})
        assert_openai_error(r, 400)


async def test_arrival_is_booked_when_the_engine_request_is_written_not_when_it_answers(frontend):
    """The planner counts demand by arrival: a unary request's engine answers at its end, yet its arrival is
    booked as soon as the request is on its way to the engine."""
    client, disc = frontend
    telemetry = client.app.state.service.telemetry
    booked: list[str] = []
    real = telemetry.on_arrival
    telemetry.on_arrival = lambda model, role=None: (booked.append(model), real(model, role))
    with FakeEngine(delay_s=1.0) as eng:
        await add(disc, client, winfo("a", eng.url))
        call = asyncio.ensure_future(client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
        deadline = time.monotonic() + 5
        while not eng.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert eng.requests and not call.done()
        assert booked == ["m"]  # booked while the engine still works on it
        assert (await call).status_code == 200
    assert booked == ["m"]


async def test_requests_reach_telemetry_and_admin_api_needs_token(frontend):
    client, disc = frontend
    store = client.app.state.telemetry_store
    with FakeEngine(tokens=4) as eng:
        await add(disc, client, winfo("a", eng.url))
        await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    rows: list = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum(b.requests for b in rows) < 2:  # flushed about once a second
        await asyncio.sleep(0.2)
        buckets = await store.read_pool_buckets(0, time.time() + 60)
        rows = [b for pool_rows in buckets.values() for b in pool_rows]
    assert sum(b.requests for b in rows) == 2 and sum(b.arrivals for b in rows) == 2
    assert sum(b.osl_sum for b in rows) == 8  # 4 streamed + 4 unary tokens, from the engines' usage
    r = await client.put("/admin/targets", json={"pools": []})  # no admin token configured: writes refused, OpenAI-style
    assert assert_openai_error(r, 403)["code"] == "admin_disabled"


def test_router_load_drain_follows_the_config():
    """kv_prefill_drain (on by default) reaches the router's load bookkeeping; off keeps the booked figure."""
    assert create_app(FrontendConfig(grpc_port=0), InMemoryDiscovery()).state.router.loads.drain is True
    assert create_app(FrontendConfig(grpc_port=0, router={"kv": {"prefill_drain": False}}), InMemoryDiscovery()).state.router.loads.drain is False


@pytest.mark.parametrize("prompt", [[-1], [[0, 1], [2, -5]], [1 << 40], [[]]])
async def test_token_id_prompts_out_of_range_are_a_400(frontend, prompt):
    client, _disc = frontend
    r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


# ---- the direct (callback) relay on kvyard's own HTTP server ------------------------------------------------


class _FloodEngine(ThreadedEngine):
    """Streams 1 KiB events as fast as its client reads them; counts the events it managed to send."""

    def __init__(self, events: int = 200_000) -> None:
        self.events, self.sent = events, 0
        self._serve_routes([
            Route("/v1/completions", self._complete, methods=["POST"]),
            Route("/health", lambda r: PlainTextResponse("")),
            Route("/metrics", lambda r: PlainTextResponse("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n")),
        ])

    async def _complete(self, request):
        await request.body()

        async def gen():
            pad = "x" * 1000
            for _ in range(self.events):
                yield f'data: {{"id":"c","choices":[{{"index":0,"text":"{pad}"}}]}}\n\n'
                self.sent += 1
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")


def _http_frontend():
    disc = InMemoryDiscovery()
    cfg = FrontendConfig(refresh_interval_s=0.05, grpc_port=0)
    app = create_app(cfg, disc)
    return app, cfg, disc


async def test_a_client_leaving_mid_stream_aborts_the_engine_request():
    app, cfg, disc = _http_frontend()
    async with frontend_client(app, cfg, "http", timeout=30) as client:
        with FakeEngine(tokens=2000) as eng:  # ~10 s of tokens
            await disc.register(winfo("a", eng.url), ttl_s=60)
            await app.state.pool.refresh()
            async with client.stream("POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}) as r:
                got = b""
                async for chunk in r.aiter_raw():
                    got += chunk
                    if got.count(b"data: ") >= 3:
                        break  # and leave: the connection closes
            loads = app.state.router.loads
            for _ in range(200):
                if eng.cancelled and loads.load("a").inflight_requests == 0:
                    break
                await asyncio.sleep(0.02)
            assert eng.cancelled == 1 and loads.load("a").inflight_requests == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_leaving_before_the_engine_answers_cancels_its_request(stream):
    """On kvyard's server the request's own task is cancelled by the connection's loss (orchestrator/client_gone.py):
    the engine call is dropped, the router's books and the admission slot are closed, the request counts cancelled."""
    app, cfg, disc = _http_frontend()
    async with frontend_client(app, cfg, "http", timeout=0.5) as client:
        with FakeEngine(tokens=5, delay_s=3.0) as eng:  # the engine's headers come after 3 s
            await disc.register(winfo("a", eng.url), ttl_s=60)
            await app.state.pool.refresh()
            with pytest.raises(httpx.ReadTimeout):  # the client gives up first and closes its connection
                await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": stream})
            loads, metrics = app.state.router.loads, app.state.metrics
            for _ in range(200):
                if loads.load("a").inflight_requests == 0:
                    break
                await asyncio.sleep(0.02)
            assert loads.load("a").inflight_requests == 0
            assert metrics.requests.labels("m", "generate", "cancelled")._value.get() == 1
            assert app.state.service.admission.inflight("m") == 0
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200  # the connection's loss cancelled that request only


async def test_a_client_that_stops_reading_stops_the_engine_read():
    """Back-pressure: the relay writes from the engine socket's read callback, so a client that reads nothing must
    pause that read (TCP then stalls the engine) rather than let the frontend buffer the whole stream."""
    app, cfg, disc = _http_frontend()
    async with frontend_client(app, cfg, "http", timeout=30) as client:
        with _FloodEngine(events=200_000) as eng:  # ~200 MB if nothing pushed back
            await disc.register(winfo("a", eng.url), ttl_s=60)
            await app.state.pool.refresh()
            port = int(str(client.base_url).rsplit(":", 1)[1].strip("/"))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"model":"m","prompt":"x","stream":true}'
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(body), body))
            await writer.drain()
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            # read nothing more: the socket buffers fill, then the frontend must stop reading the engine
            before = -1
            for _ in range(100):
                await asyncio.sleep(0.1)
                if eng.sent == before and eng.sent > 0:
                    break
                before = eng.sent
            assert 0 < eng.sent < 60_000, eng.sent  # stalled at socket buffers' worth (a few MB), not 200 MB
            stalled = eng.sent
            got = 0
            while got < 30 * 1024 * 1024:  # now read: the stream resumes
                got += len(await reader.read(1 << 20))
            assert eng.sent > stalled
            writer.close()
