"""The rest of the OpenAI surface through kvyard, with the official `openai` client against the sim engine:
/v1/embeddings (pools that embed vs generate), /v1/responses (create, stream, retrieve, previous_response_id
sticking to the worker that holds the state), and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.testing.sim_thread import ThreadedSim
from workers.discovery import InMemoryDiscovery


@pytest.fixture(scope="module")
def sims():
    with ThreadedSim() as g1, ThreadedSim() as g2, ThreadedSim("--runner", "pooling", model="emb") as e1:
        yield g1, g2, e1


@pytest.fixture
async def kvyard(sims):
    """(openai client, raw httpx client, app) on a frontend whose pool holds two generating sims and one embedding sim."""
    disc = InMemoryDiscovery()
    app = create_app(FrontendConfig(refresh_interval_s=0.05, grpc_port=0), disc)
    for wid, sim in zip(("g1", "g2", "e1"), sims):
        await disc.register(sim.info(wid), ttl_s=60)
    async with app.router.lifespan_context(app):
        await app.state.pool.refresh()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
        client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        async with http:
            yield client, http, app


async def test_embeddings_with_the_openai_client(kvyard):
    client, _, _ = kvyard
    out = await client.embeddings.create(model="emb", input=["hello world", "another text", "hello world"])  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1, 2]
    vecs = [d.embedding for d in out.data]
    assert all(len(v) == 64 and math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vecs)
    assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
    assert out.usage.prompt_tokens > 0 and out.model == "emb"
    floats = await client.embeddings.create(model="emb", input="hello world", encoding_format="float")
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(floats.data[0].embedding, vecs[0]))
    raw = await client.embeddings.with_raw_response.create(model="emb", input="x")
    assert raw.headers["x-kvyard-worker"] == "e1"


async def test_pools_know_which_models_embed(kvyard):
    client, _, _ = kvyard
    with pytest.raises(openai.BadRequestError) as exc:
        await client.embeddings.create(model="m", input="x")
    assert exc.value.body["param"] == "model" and "embedding" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.create(model="emb", input="x")
    assert exc.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        await client.embeddings.create(model="nope", input="x")
    assert exc.value.body["code"] == "model_not_found"


async def test_responses_create_retrieve_and_previous_id_stick_to_one_worker(kvyard):
    client, _, app = kvyard
    first = await client.responses.with_raw_response.create(model="m", input="Tell me a story.", max_output_tokens=8)
    r1 = first.parse()
    holder = first.headers["x-kvyard-worker"]
    assert r1.id.startswith("resp_") and r1.status in ("completed", "incomplete") and r1.output_text
    assert r1.usage.output_tokens == 8
    for _ in range(4):  # the other worker does not hold r1: it would answer 404
        nxt = await client.responses.with_raw_response.create(model="m", input="And then?", previous_response_id=r1.id,
                                                               max_output_tokens=4)
        assert nxt.headers["x-kvyard-worker"] == holder
        r2 = nxt.parse()
        assert r2.previous_response_id == r1.id
        assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens  # the earlier turn is in the prompt
    got = await client.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == r1.output_text
    # the response id is a session key: the affinity store pins it to its worker
    assert app.state.router.stages[-1].pinned_worker(r1.id) == holder
    samples = {(s.labels["model"], s.labels["endpoint"], s.labels["status"]): s.value
               for fam in app.state.metrics.requests.collect() for s in fam.samples if s.name.endswith("_total")}
    assert samples[("m", "responses", "ok")] == 5


async def test_responses_retrieve_unknown_here_is_found_on_its_worker(kvyard, sims):
    """A response this frontend never relayed (another frontend's) is looked up on each worker in turn."""
    client, http, _ = kvyard
    direct = httpx.post(sims[1].url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 3}).json()
    got = await http.get(f"/v1/responses/{direct['id']}")
    assert got.status_code == 200 and got.headers["x-kvyard-worker"] == "g2" and got.json()["id"] == direct["id"]
    with pytest.raises(openai.NotFoundError) as exc:
        await client.responses.retrieve("resp_does_not_exist")
    assert set(exc.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="m", input="x", previous_response_id="resp_does_not_exist")


async def test_responses_stream(kvyard):
    client, _, _ = kvyard
    stream = await client.responses.create(model="m", input="Stream please.", max_output_tokens=6, stream=True)
    types, text, done = [], "", None
    async for ev in stream:
        types.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            done = ev.response
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert done is not None and done.output_text == text and text
    again = await client.responses.retrieve(done.id)  # pinned from the stream's first event
    assert again.output_text == text


async def test_tokenize_and_detokenize(kvyard):
    _, http, _ = kvyard
    tok = await http.post("/tokenize", json={"model": "m", "prompt": "Hello world"})
    assert tok.status_code == 200
    body = tok.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"} and body["count"] == len(body["tokens"]) > 0
    detok = await http.post("/detokenize", json={"model": "m", "tokens": body["tokens"]})
    assert detok.status_code == 200 and "Hello world" in detok.json()["prompt"]
    chat = await http.post("/tokenize", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > body["count"] - 2
    missing = await http.post("/tokenize", json={"prompt": "x"})  # two models here: which one is ambiguous
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    bad = await http.post("/detokenize", content=b"[1,2]", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}


async def test_completions_echo_logprobs_n_and_batched_prompts(kvyard):
    client, _, _ = kvyard
    out = await client.completions.create(model="m", prompt=["Hello there", "Another prompt"], n=2, max_tokens=3, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt p's sample i is choice p * n + i, as vLLM numbers them
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 3 for c in out.choices)
    assert all(len(top) == 2 for c in out.choices for top in c.logprobs.top_logprobs)
    echo = await client.completions.create(model="m", prompt="Hello there", echo=True, max_tokens=2)
    assert echo.choices[0].text.startswith("Hello there")
    seen: dict[int, str] = {}
    async for chunk in await client.completions.create(model="m", prompt=["a b c", "d e f"], n=2, max_tokens=3, stream=True):
        for c in chunk.choices:
            seen[c.index] = seen.get(c.index, "") + c.text
    assert sorted(seen) == [0, 1, 2, 3] and all(seen.values())
    chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True,
                                                top_logprobs=2)
    assert chat.choices[0].logprobs.content and all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError):  # vLLM's max_logprobs
        await client.completions.create(model="m", prompt="x", max_tokens=2, logprobs=21)


@pytest.mark.parametrize("rid", ["..", "resp_x%2F..%2F..%2Fsleep", "resp.x", "x" * 300])
async def test_a_response_id_is_never_a_path(kvyard, rid):
    _, http, _ = kvyard
    r = await http.get(f"/v1/responses/{rid}")
    assert r.status_code == 404 and r.json()["error"]["param"] in ("response_id", None)


async def test_an_engine_without_the_route_gets_an_openai_error():
    """SGLang and TensorRT-LLM serve no /v1/responses: their framework's bare 404 reaches the client OpenAI-shaped."""
    from orchestrator.testing import FakeEngine, winfo

    disc = InMemoryDiscovery()
    app = create_app(FrontendConfig(refresh_interval_s=0.05, grpc_port=0), disc)
    with FakeEngine() as eng:
        await disc.register(winfo("a", eng.url), ttl_s=60)
        async with app.router.lifespan_context(app):
            await app.state.pool.refresh()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
                for path, body in (("/v1/responses", {"model": "m", "input": "x"}), ("/tokenize", {"model": "m", "prompt": "x"})):
                    r = await http.post(path, json=body)
                    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
                    assert path in r.json()["error"]["message"]


async def test_an_embedding_model_does_not_generate(kvyard):
    client, _, _ = kvyard
    for call in (lambda: client.completions.create(model="emb", prompt="x", max_tokens=2),
                 lambda: client.chat.completions.create(model="emb", messages=[{"role": "user", "content": "x"}], max_tokens=2)):
        with pytest.raises(openai.BadRequestError) as exc:
            await call()
        assert exc.value.body["param"] == "model" and "embedding model" in exc.value.body["message"]


async def test_previous_response_of_another_frontend_goes_to_its_worker(kvyard, sims):
    """A response created through another frontend (here: straight at g2) is found on its worker and continued there."""
    client, _, _ = kvyard
    first = httpx.post(sims[1].url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 3}).json()
    for _ in range(3):
        nxt = await client.responses.with_raw_response.create(model="m", input="more", previous_response_id=first["id"],
                                                               max_output_tokens=2)
        assert nxt.headers["x-kvyard-worker"] == "g2" and nxt.parse().previous_response_id == first["id"]


async def test_a_client_leaving_cancels_a_forwarded_request(sims):
    """The client of a slow non-streamed Response leaves: the engine request is aborted, the books closed."""
    g1 = sims[0]
    disc = InMemoryDiscovery()
    app = create_app(FrontendConfig(refresh_interval_s=60, grpc_port=0), disc)
    await disc.register(g1.info("g1"), ttl_s=60)
    async with app.router.lifespan_context(app):
        await app.state.pool.refresh()
        body = json.dumps({"model": "m", "input": "long one", "max_output_tokens": 3900}).encode()
        sent = {"done": False}

        async def receive():
            if not sent["done"]:
                sent["done"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        out = []

        async def send(message):
            out.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"host", b"127.0.0.1")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80), "scheme": "http", "root_path": "", "http_version": "1.1"}
        await asyncio.wait_for(app(scope, receive, send), 10)
        assert out[0]["status"] == 499
        loads = app.state.router.loads._loads.values()
        assert all(ld.inflight_requests == 0 for ld in loads)
        for _ in range(50):  # the engine saw the connection drop and aborted its request
            if not g1.app.state.sim.engine.streams:
                break
            await asyncio.sleep(0.05)
        assert not g1.app.state.sim.engine.streams
