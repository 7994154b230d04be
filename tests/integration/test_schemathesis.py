"""Schemathesis against the frontend's OpenAPI schema, in-process (ASGI), over a fake engine.

Every operation the frontend publishes is called with generated inputs, both conforming
(positive) and violating (negative) the schema. The contract: never a 5xx, and every 4xx is an
OpenAI error object `{"error": {"message", "type", "param", "code"}}` with a non-empty message.

The inference routes read the raw body (so that unknown OpenAI fields pass through to the
engine), which leaves FastAPI's generated schema without request bodies; this test adds the
bodies from orchestrator/protocol.py's models, so schemathesis generates real requests.
A second test throws arbitrary bytes, JSON values and headers at the same routes with hypothesis.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
import schemathesis
from schemathesis.generation import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic.json_schema import models_json_schema

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.protocol import ChatCompletionRequest, CompletionRequest
from starlette.responses import JSONResponse
from orchestrator.testing import FakeEngine
from workers.discovery import InMemoryDiscovery
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.types import WorkerInfo

pytestmark = [pytest.mark.slow]

ADMIN_TOKEN = "fuzz-admin-token"
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def _with_request_bodies(spec: dict) -> dict:
    _, defs = models_json_schema([(m, "validation") for m in BODIES.values()], ref_template="#/components/schemas/{model}")
    spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    schemas = spec["components"]["schemas"]
    for model in BODIES.values():  # a top-level field off the allowlist is refused (orchestrator/request_fields.py)
        schemas[model.__name__]["additionalProperties"] = False
    # a content part names its type (text here; image/audio parts: tests/integration/test_features_sim.py)
    text_part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"] = text_part
    for path, model in BODIES.items():
        spec["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return spec


class ValidatingEngine(FakeEngine):
    """The frontend unit tests' fake engine, answering 400 (as vLLM's own validation would) for the fuzzed
    bodies it cannot handle, where the bare fake would crash with a 500 that is no part of the frontend."""

    async def _complete(self, request):
        try:
            return await super()._complete(request)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            return JSONResponse({"error": {"message": f"invalid request: {exc}", "type": "BadRequestError", "param": None, "code": 400}},
                                status_code=400)  # vLLM 0.32's error shape (workers/sim/protocol.py)


@pytest.fixture(scope="module")
def engine():
    with ValidatingEngine(tokens=4) as eng:
        yield eng


def _app(engine: FakeEngine):
    disc = InMemoryDiscovery()
    info = WorkerInfo(worker_id="a", model="m", backend="sim", url=engine.url, block_size=16, max_model_len=256,
                      tokenizer=str(SIM_TOKENIZER_DIR))
    asyncio.run(disc.register(info, ttl_s=3600))  # before the lifespan: the pool's first refresh sees it
    # schemathesis calls the app as http://testserver: a host this test allows (the Host check is tested in test_hostile.py)
    cfg = FrontendConfig(max_body_bytes=64 * 1024, refresh_interval_s=60, grpc_port=0,
                         security={"admin_token": ADMIN_TOKEN, "allowed_hosts": ["127.0.0.1", "testserver"]})
    return create_app(cfg, disc)


@pytest.fixture(scope="module")
def api_schema(engine):
    app = _app(engine)
    schema = schemathesis.openapi.from_dict(_with_request_bodies(app.openapi()))
    schema.app = app  # case.call() goes through the app in-process, its lifespan started once
    return schema


OPERATIONS = sorted((path, method.upper()) for path, ops in create_app(FrontendConfig(grpc_port=0)).openapi()["paths"].items() for method in ops)
# negative cases need something to break: the routes with a request body (the others take no declared input)
CASES = [(p, m, GenerationMode.POSITIVE, auth) for p, m in OPERATIONS for auth in ([False, True] if p.startswith("/admin") else [False])]
CASES += [(p, "POST", GenerationMode.NEGATIVE, False) for p in sorted(BODIES)]


def check_response(status: int, content_type: str, body: bytes, what: str) -> None:
    assert status < 500, f"{what}: {status} {body[:300]!r}"
    if status >= 400:
        assert content_type.startswith("application/json"), f"{what}: {status} with {content_type}"
        err = json.loads(body)["error"]
        assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"], \
            f"{what}: malformed error {body[:300]!r}"


@pytest.mark.parametrize(("path", "method", "mode", "auth"), CASES,
                         ids=[f"{m} {p} {mode}{' admin' if a else ''}" for p, m, mode, a in CASES])
def test_openapi_operation(api_schema, path, method, mode, auth):
    operation = api_schema[path][method]
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"} if auth else None

    statuses: Counter[int] = Counter()

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), served=st.booleans())
    def run(case, served):
        if served and isinstance(case.body, dict):
            case.body["model"] = "m"  # half the time the served model, so validation and the engine path are reached
        response = case.call(headers=headers)
        statuses[response.status_code] += 1
        check_response(response.status_code, response.headers.get("content-type", [""])[0], response.content,
                       f"{case.method} {case.path} {case.body!r:.200}")

    run()
    # the generated requests reached the code behind the route, not only its front door
    if path in BODIES:  # a 400 from validation or a 404 for an unknown model: both answered behind the route
        assert statuses[400] + statuses[404] > 0, statuses
        if mode == GenerationMode.POSITIVE:
            assert statuses[200] > 0, statuses
    elif path.startswith("/admin"):
        assert (statuses[401] > 0) != auth, statuses


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
field_names = st.sampled_from(["model", "prompt", "messages", "max_tokens", "stream", "stream_options", "n", "temperature",
                               "top_p", "user", "role", "content", "include_usage", "logprobs", "stop"])
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(field_names, json_values, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.dictionaries(field_names, json_values, max_size=4).map(
        lambda d: json.dumps({"model": "m", "prompt": "hi", **d}).encode()),
    st.dictionaries(field_names, json_values, max_size=4).map(
        lambda d: json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **d}).encode()),
)


@pytest.fixture(scope="module")
def client(engine):
    app = _app(engine)
    loop = asyncio.new_event_loop()
    ctx = app.router.lifespan_context(app)
    loop.run_until_complete(ctx.__aenter__())
    c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=30)
    yield loop, c
    loop.run_until_complete(c.aclose())
    loop.run_until_complete(ctx.__aexit__(None, None, None))
    loop.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([*sorted(BODIES), "/admin/targets"]), body=bodies,
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
def test_raw_bodies_never_5xx(client, path, body, content_type):
    loop, c = client
    headers = {"content-type": content_type} if content_type else {}
    if path.startswith("/admin"):
        headers["authorization"] = f"Bearer {ADMIN_TOKEN}"
    send = c.put if path == "/admin/targets" else c.post
    r = loop.run_until_complete(send(path, content=body, headers=headers))
    check_response(r.status_code, r.headers.get("content-type", ""), r.content, f"POST {path} {body[:200]!r}")
