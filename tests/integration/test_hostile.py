"""A hostile client and a hung engine against a real frontend (uvicorn, real sockets), issue #19.

    abandoned requests   a client that leaves (unary, stream before its headers, gRPC) aborts the engine request,
                         frees the admission slot and is counted `cancelled`
    hung engine          one that accepts connections and never answers is out of routing within seconds, and
                         the requests it held are served elsewhere (not after the 300 s first-byte timeout)
    slow clients         headers or a body sent a byte at a time, or nothing at all, are cut at the deadline;
                         connections past max_connections are closed at once
    huge prompts         /live keeps answering while an 8 MB prompt (and a long one that is tokenized) is handled
    any JSON, any text   property-based: arbitrary JSON values and Unicode (lone surrogates, deep nesting) on every
                         inference route, the admin write and gRPC parameters: never a 5xx, always the OpenAI shape
                         (gRPC: INVALID_ARGUMENT), every error counted
Fast (about a minute): engines are in-process fakes, the frontend is served on the test's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.app import create_app
from orchestrator.commands import _serve
from orchestrator.config import FrontendConfig
from orchestrator.grpc.generated import pb, pb_grpc
from orchestrator.grpc.llm import encode_bytes_tensor
from orchestrator.testing import FakeEngine, ThreadedEngine, free_port
from workers.discovery import InMemoryDiscovery
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.types import WorkerInfo

ADMIN = "hostile-admin-token-0123456789"


def winfo(wid: str, url: str, max_model_len: int = 4096) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, model="m", backend="sim", url=url, block_size=16, max_model_len=max_model_len,
                      tokenizer=str(SIM_TOKENIZER_DIR))


@contextlib.asynccontextmanager
async def served(disc: InMemoryDiscovery, **cfg):
    """The frontend as `kvyard frontend` serves it (cli._serve: uvicorn + the connection guards), on this loop."""
    cfg = FrontendConfig(**{"port": free_port(), "grpc_port": 0, "refresh_interval_s": 0.2, "scrape_interval_s": 0.5, **cfg})
    app = create_app(cfg, disc)
    server = await _serve(app, cfg)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the frontend did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{cfg.port}", app
    finally:
        server.should_exit = True
        await task


def counted(app, status: str) -> float:
    return sum(s.value for fam in app.state.metrics.requests.collect() for s in fam.samples
               if s.name.endswith("_total") and s.labels["status"] == status)


async def until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


class WatchEngine(ThreadedEngine):
    """Answers after `delay_s` (headers included, streams too), unless the client goes first: then it counts an abort,
    as vLLM aborts a request whose connection dropped."""

    def __init__(self, delay_s: float = 30.0) -> None:
        self.delay_s, self.started, self.aborted, self.answered = delay_s, 0, 0, 0
        self._serve_routes([Route("/v1/completions", self._complete, methods=["POST"]),
                            Route("/health", lambda r: PlainTextResponse("")),
                            Route("/metrics", lambda r: PlainTextResponse(""))])

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.started += 1
        try:
            async with asyncio.timeout(self.delay_s):
                while (await request.receive())["type"] != "http.disconnect":
                    pass
            self.aborted += 1
            return Response(status_code=499)
        except TimeoutError:
            self.answered += 1
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        if body.get("stream"):
            async def gen():
                yield 'data: {"id":"c","choices":[{"index":0,"text":"x","finish_reason":"length"}]}\n\n'
                yield 'data: {"id":"c","choices":[],"usage":' + json.dumps(usage) + '}\n\n'
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return JSONResponse({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x"}], "usage": usage})


def raw_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(data), data))
    return s


# ---- (2) a client that leaves is aborted on the engine, on every path ---------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream-before-headers"])
async def test_client_leaving_aborts_the_engine_request(stream):
    disc = InMemoryDiscovery()
    with WatchEngine(delay_s=30) as eng:
        await disc.register(winfo("a", eng.url), 60)
        async with served(disc, admission={"max_inflight_per_model": 1, "timeout_s": 5}) as (url, app):
            port = int(url.rsplit(":", 1)[1])
            s = raw_request(port, {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream})
            await until(lambda: eng.started == 1, 10, "the engine got the request")
            s.close()  # the client leaves while the engine works (and, unary, before any header could come back)
            took = await until(lambda: eng.aborted == 1, 5, "the engine request was aborted")
            await until(lambda: counted(app, "cancelled") == 1, 5, "the request was counted cancelled")
            eng.delay_s = 0.01
            async with httpx.AsyncClient(timeout=20) as c:  # the one admission slot is free again
                r = await c.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert took < 5


async def test_grpc_client_leaving_aborts_the_engine_request():
    disc = InMemoryDiscovery()
    with WatchEngine(delay_s=30) as eng:
        await disc.register(winfo("a", eng.url), 60)
        gport = free_port()
        async with served(disc, grpc_port=gport) as (url, app):
            req = pb.ModelInferRequest(model_name="m")
            req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
            req.raw_input_contents.append(encode_bytes_tensor([b"hi"]))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gport}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=1.0)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: eng.aborted == 1, 5, "the engine request was aborted")
            await until(lambda: counted(app, "cancelled") == 1, 5, "the request was counted cancelled")


# ---- (3) a hung engine is taken out of routing within seconds ------------------------------------------------------

async def test_hung_engine_out_of_routing_and_its_requests_served_elsewhere():
    disc = InMemoryDiscovery()
    hung = socket.socket()  # accepts connections (the kernel's backlog) and never answers: a wedged or SIGSTOPped engine
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    try:
        with FakeEngine(tokens=3) as good:
            await disc.register(winfo("good", good.url), 60)
            await disc.register(winfo("hung", hung_url), 60)
            async with served(disc, router={"policy": "round-robin"}, scrape_interval_s=0.5, scrape_timeout_s=0.5, liveness_failures=2) as (url, app):
                svc = app.state.service
                t0 = time.monotonic()
                async with httpx.AsyncClient(timeout=60) as c:
                    bodies = [{"model": "m", "prompt": f"p{i}", "max_tokens": 3, "stream": i % 2 == 1} for i in range(8)]
                    rs = await asyncio.gather(*(c.post(url + "/v1/completions", json=b) for b in bodies))
                took = time.monotonic() - t0
                assert [r.status_code for r in rs] == [200] * 8, [r.text for r in rs]
                assert all(r.headers["x-kvyard-worker"] == "good" for r in rs)
                assert not svc.breakers.allows("hung")
                assert took < 15, f"requests held by the hung engine took {took:.1f} s"  # not the 300 s first-byte timeout
                trips = [s for fam in app.state.metrics.breaker_transitions.collect() for s in fam.samples
                         if s.name.endswith("_total") and s.labels == {"worker": "hung", "state": "open"}]
                assert trips and trips[0].value >= 1
    finally:
        hung.close()


# ---- (8) slow and idle clients -------------------------------------------------------------------------------------

def _closed_within(s: socket.socket, seconds: float) -> tuple[float, bytes]:
    s.settimeout(seconds)
    t0, got = time.monotonic(), b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the connection was still open after {seconds} s")
    return time.monotonic() - t0, got


async def test_slow_and_idle_connections_are_cut():
    disc = InMemoryDiscovery()
    async with served(disc, header_timeout_s=1.0, body_timeout_s=1.0) as (url, app):
        port = int(url.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()

        def idle() -> tuple[float, bytes]:
            return _closed_within(socket.create_connection(("127.0.0.1", port)), 5)

        def slow_headers() -> tuple[float, bytes]:
            s = socket.create_connection(("127.0.0.1", port))
            for b in b"GET /live HTTP/1.1\r\nhost: 127.0.0.1\r\n":
                try:
                    s.send(bytes([b]))
                except OSError:
                    break
                time.sleep(0.1)
            return _closed_within(s, 5)

        def slow_body() -> tuple[float, bytes]:
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
            return _closed_within(s, 5)

        for case in (idle, slow_headers, slow_body):
            took, got = await loop.run_in_executor(None, case)
            assert took < 4, (case.__name__, took)
            assert got.startswith(b"HTTP/1.1 408") or case is slow_body, (case.__name__, got[:100])
        reasons = {s.labels["reason"]: s.value for fam in app.state.metrics.connections_closed.collect() for s in fam.samples
                   if s.name.endswith("_total")}
        assert reasons.get("headers_timeout", 0) >= 2 and reasons.get("body_timeout", 0) >= 1, reasons
        async with httpx.AsyncClient() as c:  # the server itself is fine
            assert (await c.get(url + "/live")).status_code == 200


async def test_connections_past_the_bound_are_closed():
    disc = InMemoryDiscovery()
    async with served(disc, max_connections=4, header_timeout_s=30) as (url, app):
        port = int(url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        await asyncio.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port))
        took, _ = await asyncio.get_running_loop().run_in_executor(None, _closed_within, extra, 3)
        assert took < 2
        for s in held:
            s.close()
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient() as c:  # room again once they are gone
            assert (await c.get(url + "/live")).status_code == 200


# ---- (1) huge prompts do not freeze the loop ------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt", "ctx"), [("hello world " * 690_000, 8192), ("abcdef " * 560_000, 131072)],
                         ids=["8MB-refused-by-the-bound", "4MB-tokenized"])
async def test_live_answers_while_a_huge_prompt_is_handled(prompt, ctx):
    disc = InMemoryDiscovery()
    with FakeEngine() as eng:
        await disc.register(winfo("a", eng.url, max_model_len=ctx), 60)
        async with served(disc) as (url, app):
            await until(lambda: app.state.pool.tokenizer_dir("m") is not None, 30, "tokenizer loaded")
            done = threading.Event()
            worst = [0.0]

            def ping() -> None:  # from another thread: what a client sees while the frontend's loop is busy
                with httpx.Client(timeout=60) as c:
                    while not done.is_set():
                        t = time.perf_counter()
                        assert c.get(url + "/live").status_code == 200
                        worst[0] = max(worst[0], time.perf_counter() - t)
                        time.sleep(0.01)

            pinger = threading.Thread(target=ping)
            pinger.start()
            try:
                await asyncio.sleep(0.2)
                async with httpx.AsyncClient(timeout=60) as c:
                    r = await c.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
                await asyncio.sleep(0.1)
            finally:
                done.set()
                await asyncio.get_running_loop().run_in_executor(None, pinger.join)
            worst = worst[0]
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
            assert worst < 1.0, f"/live waited {worst:.2f} s behind one prompt"


# ---- (5) any JSON, any Unicode, on every route: never a 5xx, always the OpenAI shape, always counted -----------------

unicode_text = st.text(alphabet=st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)), max_size=12)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | unicode_text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(unicode_text, inner, max_size=3),
                           max_leaves=10)
deep = st.integers(min_value=60, max_value=3000).map(lambda n: "[" * n + "]" * n)
fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
                          "temperature", "top_p", "stop", "user", "logit_bias", "response_format", "kv_transfer_params",
                          "bootstrap_host", "tools", "seed", "pools", "role", "content"])


def _doc(base: dict):
    return st.dictionaries(fields, json_values, max_size=4).map(lambda d: json.dumps({**base, **d}))


def _with_deep(base: dict):
    return deep.map(lambda d: json.dumps(base)[:-1] + ', "logit_bias": ' + d + "}")


bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(json.dumps),
    _doc({}), _doc({"model": "m", "prompt": "hi"}), _doc({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    unicode_text.map(lambda t: json.dumps({"model": "m", "prompt": t, "max_tokens": 2})),
    unicode_text.map(lambda t: json.dumps({"model": "m", "messages": [{"role": "user", "content": t}], "max_tokens": 2})),
    unicode_text.map(lambda t: json.dumps({"pools": [{"model": t, "role": "both", "min_replicas": 1, "max_replicas": 2}]})),
    _with_deep({"model": "m", "prompt": "hi"}),
).map(lambda b: b if isinstance(b, bytes) else b.encode("utf-8", "surrogatepass"))


@pytest.fixture(scope="module")
def inproc():
    """The frontend in-process (ASGI) with one fake engine, and its gRPC endpoint, on a loop of the module's own."""
    with FakeEngine(tokens=2) as eng:
        disc = InMemoryDiscovery()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)  # grpc.aio looks the loop up as the current one
        loop.run_until_complete(disc.register(winfo("a", eng.url, max_model_len=256), 3600))
        gport = free_port()
        app = create_app(FrontendConfig(max_body_bytes=64 * 1024, refresh_interval_s=60, grpc_port=gport,
                                        security={"admin_token": ADMIN}), disc)
        ctx = app.router.lifespan_context(app)
        loop.run_until_complete(ctx.__aenter__())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=30)
        async def open_channel():
            return grpc.aio.insecure_channel(f"127.0.0.1:{gport}")

        channel = loop.run_until_complete(open_channel())
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.channel = channel  # raw calls too (a message protobuf cannot parse)
        yield loop, client, app, stub
        loop.run_until_complete(channel.close())
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(ctx.__aexit__(None, None, None))
        asyncio.set_event_loop(None)
        loop.close()


def _errors_counted(app) -> float:
    return sum(s.value for fam in app.state.metrics.requests.collect() for s in fam.samples
               if s.name.endswith("_total") and s.labels["status"].isdigit() and int(s.labels["status"]) >= 400)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from(["POST /v1/completions", "POST /v1/chat/completions", "PUT /admin/targets"]), body=bodies)
def test_any_json_any_text_every_route(inproc, route, body):
    loop, client, app, _ = inproc
    method, path = route.split()
    headers = {"content-type": "application/json", "authorization": f"Bearer {ADMIN}"}
    before = _errors_counted(app)
    r = loop.run_until_complete(client.request(method, path, content=body, headers=headers))
    assert r.status_code < 500 or r.status_code == 503, (route, body[:200], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.text[:200]
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
        assert _errors_counted(app) == before + 1, (route, r.status_code)


grpc_params = st.dictionaries(st.sampled_from(["max_tokens", "temperature", "stop", "top_k", "seed", "ignore_eos", "bogus"]),
                              st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.text(max_size=8)), max_size=3)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sampling=bodies, text=st.binary(max_size=40) | unicode_text.map(lambda t: t.encode("utf-8", "surrogatepass")), params=grpc_params)
def test_grpc_parameters_any_json_any_text(inproc, sampling, text, params):
    loop, _, app, stub = inproc
    req = pb.ModelInferRequest(model_name="m")
    for name, raw in (("text_input", text), ("sampling_parameters", sampling)):
        req.inputs.add(name=name, datatype="BYTES", shape=[1])
        req.raw_input_contents.append(encode_bytes_tensor([raw]))
    for k, v in params.items():
        p = req.parameters[k]
        if isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int):
            p.int64_param = max(-2**63, min(2**63 - 1, v))
        elif isinstance(v, float):
            p.double_param = v
        else:
            p.string_param = v
    before = _errors_counted(app)
    try:
        loop.run_until_complete(stub.ModelInfer(req, timeout=30))
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                              grpc.StatusCode.RESOURCE_EXHAUSTED), (exc.code(), exc.details(), sampling[:200])
        assert _errors_counted(app) == before + 1


def test_grpc_unparsable_message_is_invalid_argument(inproc):
    loop, _, app, stub = inproc
    raw = pb.ModelInferRequest(model_name="mXm").SerializeToString().replace(b"mXm", b"m\xffm")  # invalid UTF-8 in a string
    call = stub.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    before = _errors_counted(app)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        loop.run_until_complete(call(raw, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be parsed" in err.value.details()
    assert _errors_counted(app) == before + 1
