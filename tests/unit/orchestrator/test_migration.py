"""Mid-stream migration: a stream that breaks after tokens reached the client is continued on another
worker, and the client sees one well-formed answer (same id/created/model, one usage, right totals)."""

from __future__ import annotations

import json

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.resilience.migration import (
    ChunkRewriter,
    StreamTracker,
    continuation_body,
    migration_blocker,
    strip_token_ids,
)
from orchestrator.tokenizer import load_tokenizer
from workers.discovery import InMemoryDiscovery
from orchestrator.testing.frontend_client import TRANSPORTS, frontend_client
from workers.sim.backend import SIM_TOKENIZER_DIR as TOKENIZER_DIR
from workers.types import WorkerInfo

from orchestrator.testing import TOKEN_BASE, WORDS, FaultEngine

TOK = load_tokenizer(str(TOKENIZER_DIR))


def winfo(wid: str, url: str, backend: str = "sim", protocol: str | None = "sglang") -> WorkerInfo:
    """By default an engine that returns no token ids (the sim playing SGLang): continuations re-tokenize."""
    return WorkerInfo(worker_id=wid, model="m", backend=backend, url=url, block_size=16, max_model_len=4096, tokenizer=str(TOKENIZER_DIR),
                      pd_protocol=protocol if backend == "sim" else None)


@pytest.fixture(params=TRANSPORTS)
def over(request) -> str:
    """Streams relayed over ASGI (send per piece) and over kvyard's HTTP server (the direct, callback path)."""
    return request.param


@pytest.fixture
async def frontend(request, over):
    overrides = getattr(request, "param", {})
    disc = InMemoryDiscovery()
    overrides = {**overrides, "resilience": {"retry_backoff_base_s": 0.0, **overrides.get("resilience", {})}}
    cfg = FrontendConfig(refresh_interval_s=0.05, grpc_port=0, **overrides)
    app = create_app(cfg, disc)
    async with frontend_client(app, cfg, over, timeout=30) as client:
        client.app = app
        yield client, disc


async def add(disc, client, *infos):
    for i in infos:
        await disc.register(i, ttl_s=60)
    await client.app.state.pool.refresh()


def sse(text: str) -> list[dict | str]:
    out = []
    for ev in text.split("\n\n"):
        if not ev:
            continue
        assert ev.startswith("data: "), ev
        out.append("[DONE]" if ev == "data: [DONE]" else json.loads(ev[6:]))
    return out


def counter(client, name: str, **labels) -> float:
    v = client.app.state.metrics.registry.get_sample_value(name, labels)
    return v or 0.0


def two_engines(plan):
    return FaultEngine("a", plan=plan), FaultEngine("b", plan=plan)


# ---- through the frontend ------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [{"break_after": 3}, {"stop_after": 3}])
async def test_completions_stream_migrated_exactly(frontend, fault):
    client, disc = frontend
    plan = [dict(fault)]
    a, b = two_engines(plan)
    with a, b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        body = {"model": "m", "prompt": "hello world", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200
        events = sse(r.text)
        first, second = (a, b) if a.requests and a.requests[0]["body"]["prompt"] == "hello world" else (b, a)
        # the continuation: prompt ids + the 3 generated ids, max_tokens 8 - 3, on the other worker
        cont = second.requests[-1]
        assert cont["path"] == "/v1/completions"
        gen = "".join(WORDS[:3])
        assert cont["body"]["prompt"] == TOK.encode("hello world") + TOK.encode(gen, add_special_tokens=False)
        assert cont["body"]["max_tokens"] == 5 and cont["body"]["stream"] is True
        assert "return_token_ids" not in cont["body"]  # an engine without token ids: re-tokenized
        # the client: one answer, one id, 8 tokens of text, one usage with the totals, then [DONE]
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        usages = [e for e in events[:-1] if not e["choices"]]
        assert {c["id"] for c in chunks + usages} == {chunks[0]["id"]}
        assert {c["created"] for c in chunks + usages} == {chunks[0]["created"]}
        assert {c["model"] for c in chunks + usages} == {"m"}
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert len(TOK.encode(text, add_special_tokens=False)) == 8
        assert text == "".join(WORDS[:3]) + "".join(WORDS[:5])
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
        assert len(usages) == 1
        assert usages[0]["usage"] == {"prompt_tokens": len(TOK.encode("hello world")), "completion_tokens": 8,
                                      "total_tokens": len(TOK.encode("hello world")) + 8}
        assert all("error" not in e for e in events[:-1])
        assert counter(client, "kvyard_migrations_total", model="m", outcome="migrated") == 1
        assert len(first.requests) == 1


async def test_chat_stream_migrated_as_chat_chunks(frontend):
    client, disc = frontend
    plan = [{"break_after": 2}]
    a, b = two_engines(plan)
    with a, b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        msgs = [{"role": "user", "content": "tell me a story"}]
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_completion_tokens": 6,
                                                            "temperature": 0.5, "stream": True})
        events = sse(r.text)
        cont = next(q for e in (a, b) for q in e.requests if q["path"] == "/v1/completions")
        assert cont["body"]["prompt"] == TOK.encode_chat(msgs) + TOK.encode(WORDS[0] + WORDS[1], add_special_tokens=False)
        assert cont["body"]["max_tokens"] == 4 and cont["body"]["temperature"] == 0.5
        assert "messages" not in cont["body"] and "max_completion_tokens" not in cont["body"]
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert not any("usage" in c for c in chunks)  # not asked for
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == WORDS[0] + WORDS[1] + "".join(WORDS[:4])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_a_lazily_tokenized_prompt_migrates_with_every_prompt_id(frontend):
    """A long prompt on event-fed workers is tokenized only as far as routing needs (orchestrator/prepare.py); a
    migration tokenizes the rest: the continuation's prompt is still exactly the prompt's ids + the generated ones."""
    client, disc = frontend
    a, b = two_engines([{"break_after": 2}])
    with a, b:
        await add(disc, client, *(WorkerInfo(**{**winfo(w, e.url).__dict__, "max_model_len": 65536}) for w, e in (("a", a), ("b", b))))
        index = client.app.state.service.router.kv_index
        for w in ("a", "b"):
            index.add_worker(w)  # as if each published KV events
        doc = " ".join(f"Line {i} of a long document nobody sent before." for i in range(400))
        msgs = [{"role": "user", "content": doc}]
        full = TOK.encode_chat(msgs)
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 6, "stream": True,
                                                            "stream_options": {"include_usage": True}})
        events = sse(r.text)
        cont = next(q for e in (a, b) for q in e.requests if q["path"] == "/v1/completions")
        assert cont["body"]["prompt"] == full + TOK.encode(WORDS[0] + WORDS[1], add_special_tokens=False)
        usage = [e for e in events[:-1] if not e["choices"]]
        assert usage[0]["usage"]["prompt_tokens"] == len(full) and usage[0]["usage"]["completion_tokens"] == 6


async def test_vllm_token_ids_used_and_hidden(frontend):
    """On vLLM workers the frontend asks for token ids: the continuation uses the engine's ids (not a
    re-tokenization), and the client never sees them."""
    client, disc = frontend
    plan = [{"break_after": 3}]
    a, b = two_engines(plan)
    with a, b:
        await add(disc, client, winfo("a", a.url, "vllm"), winfo("b", b.url, "vllm"))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 6, "stream": True})
        events = sse(r.text)
        first = next(q for e in (a, b) for q in e.requests if q["body"]["prompt"] == [5, 6, 7])
        assert first["body"]["return_token_ids"] is True
        cont = next(q for e in (a, b) for q in e.requests if q["body"]["prompt"] != [5, 6, 7])
        assert cont["body"]["prompt"] == [5, 6, 7, TOKEN_BASE, TOKEN_BASE + 1, TOKEN_BASE + 2]
        assert cont["body"]["max_tokens"] == 3
        assert "token_ids\":[" not in r.text
        chunks = [e for e in events[:-1]]
        assert all(c["choices"][0]["token_ids"] is None for c in chunks)
        assert all(c["choices"][0].get("prompt_token_ids") is None for c in chunks)
        assert len(chunks) == 6


@pytest.mark.parametrize("backend,protocol,asked", [("vllm", None, True), ("sim", None, True), ("sim", "vllm", True),
                                                    ("sim", "sglang", False), ("sim", "trtllm", False), ("sglang", None, False)])
async def test_token_ids_asked_of_engines_that_return_them(frontend, backend, protocol, asked):
    """vLLM and the sim in its vLLM flavor answer `return_token_ids`: the frontend asks them (exact
    continuations even when an engine coalesces tokens into one chunk); others get the client's body."""
    client, disc = frontend
    a = FaultEngine("a", plan=[])
    with a:
        await add(disc, client, winfo("a", a.url, backend, protocol))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and "token_ids\":[" not in r.text
        assert ("return_token_ids" in a.requests[0]["body"]) is asked


async def test_client_asking_token_ids_keeps_them(frontend):
    client, disc = frontend
    a, b = two_engines([{"break_after": 2}])
    with a, b:
        await add(disc, client, winfo("a", a.url, "vllm"), winfo("b", b.url, "vllm"))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 4, "stream": True, "return_token_ids": True})
        chunks = sse(r.text)[:-1]
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[TOKEN_BASE], [TOKEN_BASE + 1], [TOKEN_BASE], [TOKEN_BASE + 1]]


@pytest.mark.parametrize("extra", [{"n": 2}, {"logprobs": 1}, {"echo": True}])
async def test_unmigratable_stream_ends_with_clean_error(frontend, extra):
    client, disc = frontend
    a, b = two_engines([{"break_after": 2}])
    with a, b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 5, "stream": True, **extra})
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert set(err) == {"message", "type", "param", "code"} and "cannot be continued" in err["message"]
        assert len(a.requests) + len(b.requests) == 1
        assert counter(client, "kvyard_migrations_total", model="m", outcome="refused") == 1


@pytest.mark.parametrize("frontend", [{"resilience": {"max_migrations": 1}}], indirect=True)
async def test_migration_limit(frontend):
    client, disc = frontend
    plan = [{"break_after": 1}, {"break_after": 1}]
    a, b, c = FaultEngine("a", plan=plan), FaultEngine("b", plan=plan), FaultEngine("c", plan=plan)
    with a, b, c:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url), winfo("c", c.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 6, "stream": True})
        events = sse(r.text)
        assert events[-1] == "[DONE]" and "max_migrations=1" in events[-2]["error"]["message"]
        assert len(a.requests) + len(b.requests) + len(c.requests) == 2
        assert counter(client, "kvyard_migrations_total", model="m", outcome="exhausted") == 1


async def test_two_migrations_one_answer(frontend):
    client, disc = frontend
    plan = [{"break_after": 2}, {"break_after": 2}]
    a, b, c = FaultEngine("a", plan=plan), FaultEngine("b", plan=plan), FaultEngine("c", plan=plan)
    with a, b, c:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url), winfo("c", c.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 7, "stream": True,
                                                       "stream_options": {"include_usage": True}})
        events = sse(r.text)
        usage = [e for e in events[:-1] if not e["choices"]]
        assert usage[0]["usage"]["completion_tokens"] == 7
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert len(TOK.encode(text, add_special_tokens=False)) == 7
        assert counter(client, "kvyard_migrations_total", model="m", outcome="migrated") == 2


async def test_break_before_any_token_is_a_plain_retry(frontend):
    client, disc = frontend
    a, b = two_engines([{"break_after": 0}])
    with a, b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True, "n": 2})
        events = sse(r.text)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        assert len(events) == 4
        # the retry is the original request (n=2 would not be migratable, but nothing had reached the client)
        assert [q["body"]["prompt"] for e in (a, b) for q in e.requests] == ["hi", "hi"]


async def test_lost_final_chunk_only_closes_the_stream(frontend):
    """The engine died after its last token: nothing is re-generated, the stream is just ended well."""
    client, disc = frontend
    a, b = two_engines([{"stop_after": 4}])
    with a, b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4, "stream": True,
                                                       "stream_options": {"include_usage": True}})
        events = sse(r.text)
        assert len(a.requests) + len(b.requests) == 1
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 4
        assert events[-3]["choices"][0]["finish_reason"] == "length"


async def test_lost_done_after_usage_adds_only_done(frontend):
    """The engine died after its usage chunk reached the client: only [DONE] follows (no second usage)."""
    client, disc = frontend
    a, b = two_engines([{"break_before_done": True}])
    with a, b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4, "stream": True,
                                                       "stream_options": {"include_usage": True}})
        events = sse(r.text)
        assert len(a.requests) + len(b.requests) == 1  # nothing re-generated
        assert events[-1] == "[DONE]"
        usages = [e for e in events[:-1] if not e["choices"]]
        assert len(usages) == 1 and usages[0]["usage"]["completion_tokens"] == 4


# ---- the pieces -------------------------------------------------------------------------------------


def test_blockers():
    ok = {"model": "m", "prompt": "x", "stream": True}
    assert migration_blocker("completions", ok, True) is None
    assert migration_blocker("completions", {**ok, "stream": False}, True) == "not streamed"
    assert migration_blocker("completions", {**ok, "prompt": ["a", "b"]}, True) == "several prompts"
    assert migration_blocker("completions", ok, False) is None  # text fallback
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert migration_blocker("chat", chat, True) is None
    assert migration_blocker("chat", chat, False) is not None
    assert migration_blocker("chat", {**chat, "tools": [{"type": "function"}]}, True) == "tools"
    assert migration_blocker("chat", {**chat, "response_format": {"type": "json_object"}}, True) == "response_format"
    assert migration_blocker("chat", {**chat, "response_format": {"type": "text"}}, True) is None
    img = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert migration_blocker("chat", {**chat, "messages": [img]}, True) == "multi-modal content"


def test_continuation_bodies_exact():
    body = {"model": "m", "prompt": "p", "max_tokens": 10, "min_tokens": 4, "stream": True, "seed": 7,
            "stream_options": {"include_usage": False}, "stop": ["\n"]}
    out = continuation_body("completions", body, [1, 2], [9, 9, 9], "abc", 3, 10, False)
    assert out == {"model": "m", "prompt": [1, 2, 9, 9, 9], "max_tokens": 7, "min_tokens": 1, "stream": True, "seed": 7,
                   "stop": ["\n"], "stream_options": {"include_usage": True}}
    # no tokenizer: text continuation
    out = continuation_body("completions", body, [], None, " abc", 3, 10, False)
    assert out["prompt"] == "p abc"
    chat = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 5, "tools": None,
            "temperature": 0.2, "stream": True, "chat_template_kwargs": {}}
    out = continuation_body("chat", chat, [4], [8], "x", 1, 5, True)
    assert out == {"model": "m", "temperature": 0.2, "prompt": [4, 8], "max_tokens": 4, "stream": True,
                   "stream_options": {"include_usage": True}, "return_token_ids": True}
    # a chat client that asked for ids keeps getting them from the continuation
    assert continuation_body("chat", {**chat, "return_token_ids": True}, [4], [8], "x", 1, 5, False)["return_token_ids"] is True
    # max_tokens unknown (the engine fills to the context): not set
    assert "max_tokens" not in continuation_body("completions", {**body, "max_tokens": None}, [1], [2], "", 1, None, False)
    # a long prompt's ids come as a uint32 array (orchestrator/token_cache.py): the body holds a list, written as JSON
    from array import array

    from orchestrator.json_input import dump_json
    out = continuation_body("chat", chat, array("I", [4, 70000]), [8], "x", 1, 5, True)
    assert out["prompt"] == [4, 70000, 8] and type(out["prompt"]) is list
    assert b'"prompt":[4,70000,8]' in dump_json(out)


def test_tracker_and_rewriter():
    t = StreamTracker()
    t.feed(b'data: {"id":"c1","object":"chat.completion.chunk","created":5,"model":"m","system_fingerprint":"fp",'
           b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}')
    t.feed(b'data: {"id":"c1","created":5,"model":"m","choices":[{"index":0,"delta":{"content":" a"},"finish_reason":null,"token_ids":[11]}]}')
    assert t.generated_ids(None) == ([11], True)
    t.feed(b'data: {"id":"c1","created":5,"model":"m","choices":[{"index":0,"delta":{"content":""},"finish_reason":null,"token_ids":[12,13]}]}')
    assert t.generated_ids(None) == ([11], True) and t.held == 2  # held-back text: those ids are regenerated
    t.feed(b'data: {"id":"c1","created":5,"model":"m","choices":[{"index":0,"delta":{"content":"\\u00e9"},"finish_reason":null,"token_ids":[14]}]}')
    assert t.generated_ids(None) == ([11, 12, 13, 14], True)
    t.feed(b'data: {"id":"c1","created":5,"model":"m","choices":[{"index":0,"delta":{"content":" b"},"finish_reason":null}]}')
    assert t.generated_ids(None) == (None, False)  # a chunk without ids: fall back to re-tokenizing
    assert t.generated_ids(lambda s: [len(s)]) == ([2, 1, 2], False)  # chunk by chunk
    t.feed(b"data: {not json")
    assert t.blocked == "unreadable chunk"
    rw = ChunkRewriter("chat", t, prompt_tokens=10, generated_before=2, keep_token_ids=False)
    out = json.loads(rw(b'data: {"id":"cmpl-x","object":"text_completion","created":99,"model":"m","choices":[{"index":0,'
                        b'"text":" c","logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":[3]}],'
                        b'"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13}}')[6:])
    assert out == {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m", "system_fingerprint": "fp",
                   "choices": [{"index": 0, "delta": {"content": " c"}, "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
                   "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}
    assert rw(b'data: {"error":{"message":"x"}}') == b'data: {"error":{"message":"x"}}'


def test_strip_token_ids():
    ev = b'data: {"choices":[{"text":"a","prompt_token_ids":[1, 2,3],"token_ids":[4]}]}'
    assert strip_token_ids(ev) == b'data: {"choices":[{"text":"a","prompt_token_ids":null,"token_ids":null}]}'
    assert strip_token_ids(b'data: {"token_ids":null}') == b'data: {"token_ids":null}'


def _tracker_state(t: StreamTracker) -> tuple:
    return (t.id, t.created, t.model, t.system_fingerprint, list(t.parts), t.token_ids and list(t.token_ids), t.held,
            t.finish_reason, t.events, t.blocked)


from orchestrator.resilience import migration as _migration  # noqa: E402

BUFFERS = [pytest.param(_migration._EventBuffer, id="python"),
           pytest.param(_migration.EventBuffer, id="c", marks=pytest.mark.skipif(
               _migration.EventBuffer is _migration._EventBuffer, reason="orchestrator._relaycore not built"))]


@pytest.mark.parametrize("buffer", BUFFERS)
def test_the_lazy_tracker_reads_as_an_eager_decode_would(buffer):
    """Fields read at any point equal those of a tracker that decoded every event as it came (read after each feed)."""
    import random

    events = [
        b'data: {"id":"c1","created":5,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":" a"},"token_ids":[11]}]}',
        b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":""},"token_ids":[12]}]}',
        b'data: {"id":"c1","choices":[{"index":0,"text":"t","token_ids":[13,14]}]}',
        b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":" b"}}]}',
        b'data: {"id":"c1","choices":[{"index":1,"delta":{"content":"n2"}}]}',
        b'data: {"id":"c1","choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}',
        b'data: {"error":{"message":"x"}}',
        b"data: {not json",
        b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"."},"finish_reason":"stop","token_ids":[15]}]}',
    ]
    for seed in range(100):
        rng = random.Random(seed)
        stream = [rng.choice(events) for _ in range(rng.randint(1, 30))]
        eager, lazy = StreamTracker(buffer), StreamTracker(buffer)
        for i, ev in enumerate(stream):
            eager.feed(ev)
            _tracker_state(eager)  # reading decodes: eager
            lazy.feed(ev)
            if rng.random() < 0.1:  # a read now and then, as a migration would
                assert _tracker_state(lazy) == _tracker_state(eager)
        assert _tracker_state(lazy) == _tracker_state(eager)
        assert lazy.generated_ids(lambda s: [len(s)]) == eager.generated_ids(lambda s: [len(s)])


@pytest.mark.parametrize("buffer", BUFFERS)
def test_the_lazy_tracker_holds_a_bounded_window_of_raw_events(buffer):
    t = StreamTracker(buffer)
    ev = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":" word"},"token_ids":[7]}]}'
    n = 3 * _migration.PENDING_BYTES // len(ev)
    for _ in range(n):
        t.feed(ev)
        assert t._pending.nbytes <= _migration.PENDING_BYTES and len(t._pending) * len(ev) == t._pending.nbytes
    assert t.events == n and t.token_ids == [7] * n and "".join(t.parts) == " word" * n
    assert len(t._pending) == 0


@pytest.mark.parametrize("buffer", BUFFERS)
def test_the_tracker_drops_the_prompt_ids_of_a_role_chunk(buffer):
    """vLLM's return_token_ids puts the prompt's ids on the role chunk: the tracker keeps the rest of the event, and
    reads the same fields as from the event whole."""
    import json as _json

    from orchestrator.resilience.migration import without_prompt_ids

    ids = list(range(100000, 118000))
    role = b"data: " + _json.dumps({"id": "c1", "created": 5, "model": "m", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}], "prompt_token_ids": ids},
        separators=(",", ":")).encode()
    tok = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":" a"},"token_ids":[11]}]}'
    t = StreamTracker(buffer)
    whole = StreamTracker(lambda limit, on_full, big, on_ids: buffer(limit, on_full, 1 << 30, on_ids))  # every event whole
    t.feed(role)
    assert t._pending.nbytes < 400 and len(t._pending) == 1  # kept small, not decoded on the spot
    t.feed(tok)
    for ev in (role, tok):
        whole.feed(ev)  # the role chunk whole, past PENDING_BYTES: decoded at once, as before the cut
    assert _tracker_state(t) == _tracker_state(whole)
    assert t.token_ids == [11] and t.id == "c1" and t.model == "m"
    cut = without_prompt_ids(role)
    assert _json.loads(cut[6:])["prompt_token_ids"] is None and _json.loads(cut[6:])["choices"] == _json.loads(role[6:])["choices"]
    # the completions shape (ids in each choice), several in one event, text that only looks like the key
    ev = b'data: {"choices":[{"index":0,"text":"\\"prompt_token_ids\\":[1]","prompt_token_ids":[1,2,3],"token_ids":[4]}],' \
         b'"prompt_token_ids":[5,6]}'
    out = without_prompt_ids(ev)
    assert _json.loads(out[6:]) == {"choices": [{"index": 0, "text": '"prompt_token_ids":[1]', "prompt_token_ids": None,
                                                 "token_ids": [4]}], "prompt_token_ids": None}
    assert without_prompt_ids(b"data: {}") == b"data: {}"


@pytest.mark.skipif(_migration.EventBuffer is _migration._EventBuffer, reason="orchestrator._relaycore not built")
@pytest.mark.parametrize("seed", range(50))
def test_the_c_event_buffer_matches_the_python_one(seed):
    """The same events kept (cut the same way), the same on_full calls at the same points, the same takes."""
    import random

    rng = random.Random(seed)
    ids = b",".join(b"%d" % rng.randrange(1 << 20) for _ in range(rng.randint(0, 3000)))
    bad = rng.choice([b"1,-2", b"1.5", b"4294967296", b"1,,2", b"", b"x", b"1 2", b"12345678901"])
    atoms = [b'data: {"choices":[{"index":0,"delta":{"content":"x"},"token_ids":[1]}]}',
             b'data: {"prompt_token_ids":[' + ids + b'],"choices":[]}',
             b'data: {"choices":[{"prompt_token_ids":[' + ids + b'],"text":"\\"prompt_token_ids\\":[9]"}],"prompt_token_ids":[1,2]}',
             b'data: {"prompt_token_ids":[' + ids,  # an array that never closes
             b'data: {"prompt_token_ids":[' + bad + b'],"later":{"prompt_token_ids":[ 4294967295 ,0\t]}}' + b" " * 5000,
             b"data: " + b"y" * rng.randint(0, 9000), b""]
    limit, big = rng.choice([64, 1000, 1 << 16]), rng.choice([0, 16, 4096])
    offered = rng.random() < 0.7

    def run(cls):
        log: list = []
        buf = cls(limit, lambda: log.append(("full", buf.nbytes, len(buf))), big,
                  (lambda ids: log.append(("ids", ids))) if offered else None)
        for _ in range(rng2.randint(1, 60)):
            buf.feed(rng2.choice(atoms))
            log.append(("kept", buf.nbytes, len(buf)))
            if rng2.random() < 0.1:
                log.append(("take", buf.take(), buf.nbytes, len(buf)))
        log.append(("take", buf.take()))
        return log

    rng2 = random.Random(seed)
    py = run(_migration._EventBuffer)
    rng2 = random.Random(seed)
    assert run(_migration.EventBuffer) == py
    with pytest.raises(TypeError):
        _migration.EventBuffer(10, lambda: None).feed("text")


@pytest.mark.parametrize("buffer", BUFFERS)
def test_the_buffer_hands_on_the_prompt_ids_once(buffer, monkeypatch, caplog):
    """on_prompt_ids gets the first parsable prompt_token_ids array of a big event, as native uint32s, once; a
    callback that raises breaks nothing (the event is kept as without it)."""
    from array import array

    got = []
    buf = buffer(1 << 16, lambda: None, 64, got.append)
    small = b'data: {"prompt_token_ids":[1,2]}'
    buf.feed(small)  # not big: kept whole, nothing offered
    assert got == [] and buf.take() == [small]
    pad = b"," + b'"p":"' + b"z" * 100 + b'"}'
    buf.feed(b'data: {"prompt_token_ids":[1,x],"choices":[]' + pad)  # unparsable: not offered, still cut
    buf.feed(b'data: {"prompt_token_ids":[ 7, 4294967295,0 ],"choices":[]' + pad)
    buf.feed(b'data: {"prompt_token_ids":[8],"choices":[]' + pad)  # once only
    assert [array("I", g).tolist() for g in got] == [[7, 4294967295, 0]]
    assert [ev.startswith(b'data: {"prompt_token_ids":null') for ev in buf.take()] == [True, True, True]

    def boom(ids):
        raise ValueError("learning failed")

    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    loud = buffer(1 << 16, lambda: None, 64, boom)
    loud.feed(b'data: {"prompt_token_ids":[3],"choices":[]' + pad)  # reported, not raised
    assert loud.take() == [b'data: {"prompt_token_ids":null,"choices":[]' + pad]
    assert [type(u.exc_value) for u in unraisable] == [ValueError] or "on_prompt_ids failed" in caplog.text
    t = StreamTracker(buffer, on_prompt_ids=got.append)
    t.feed(b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[5,6],"p":"' + b"z" * 5000 + b'"}')
    assert array("I", got[-1]).tolist() == [5, 6] and t.id == "c"
