"""`return_token_ids` and `n > 1` in the sim, shaped like vLLM 0.32 (captures in workers/sim/responses.py).

Runs the sim app in process (Starlette's TestClient drives the lifespan, so the engine loop runs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from workers.sim.config import parse_args
from workers.sim.server import build_app

PROMPT = "Tell me a story about the sea and the ships."
CHAT = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    cfg = parse_args(["--model", "h200-llama3.1-8b", "--served-model-name", "m", "--speedup", "50", "--port", "0"])
    with TestClient(build_app(cfg)) as c:
        yield c


def sse(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n")[:-2]]


def stream(client: TestClient, path: str, body: dict) -> list[dict]:
    r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    return sse(r.text)


def prompt_ids(client: TestClient, **body) -> list[int]:
    return client.post("/tokenize", json={"model": "m", **body}).json()["tokens"]


def test_completion_token_ids_non_streaming_and_streaming(client):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 20, "return_token_ids": True}
    full = client.post("/v1/completions", json=body).json()
    ch = full["choices"][0]
    assert ch["prompt_token_ids"] == prompt_ids(client, prompt=PROMPT)
    assert len(ch["token_ids"]) == full["usage"]["completion_tokens"] == 20
    chunks = stream(client, "/v1/completions", body)
    content = [c["choices"][0] for c in chunks if c["choices"]]
    assert content[0]["prompt_token_ids"] == ch["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in content[1:])
    assert all(c["token_ids"] for c in content)  # every chunk lists its delta's ids, several when coalesced
    assert sum((c["token_ids"] for c in content), []) == ch["token_ids"]
    assert "".join(c["text"] for c in content) == ch["text"]


def test_chat_token_ids_and_prompt_ids_at_the_top(client):
    body = {"model": "m", "messages": CHAT, "max_tokens": 12, "return_token_ids": True}
    full = client.post("/v1/chat/completions", json=body).json()
    assert full["prompt_token_ids"] == prompt_ids(client, messages=CHAT)
    assert len(full["choices"][0]["token_ids"]) == 12 and "prompt_token_ids" not in full["choices"][0]
    chunks = stream(client, "/v1/chat/completions", body)
    role, rest = chunks[0], chunks[1:-1]
    assert role["choices"][0]["delta"]["role"] == "assistant" and role["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in rest)
    assert sum((c["choices"][0]["token_ids"] for c in rest), []) == full["choices"][0]["token_ids"]


def test_without_the_flag_the_fields_stay_null(client):
    full = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4}).json()
    assert full["choices"][0]["token_ids"] is None and full["choices"][0]["prompt_token_ids"] is None
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 4}).json()
    assert chat["prompt_token_ids"] is None and chat["choices"][0]["token_ids"] is None
    for c in stream(client, "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 4})[:-1]:
        assert c["choices"][0]["token_ids"] is None and c["choices"][0]["prompt_token_ids"] is None


def test_stop_string_drops_the_coalesced_tokens_after_it(client):
    base = {"model": "m", "prompt": PROMPT, "max_tokens": 30, "return_token_ids": True}
    ref = client.post("/v1/completions", json=base).json()["choices"][0]
    words = ref["text"].split(" ")
    stop = words[6]  # a word well inside the output; the tokens after it must not be reported
    assert stop
    for streamed in (False, True):
        if streamed:
            content = [c["choices"][0] for c in stream(client, "/v1/completions", {**base, "stop": [stop]})[:-1]]
            ids, text = sum((c["token_ids"] for c in content), []), "".join(c["text"] for c in content)
        else:
            ch = client.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
            ids, text = ch["token_ids"], ch["text"]
        assert text == ref["text"][: ref["text"].index(stop)]
        k = len(ids)
        assert ids == ref["token_ids"][:k]
        kept_text = client.post("/detokenize", json={"model": "m", "tokens": ids}).json()["prompt"]
        before = client.post("/detokenize", json={"model": "m", "tokens": ids[:-1]}).json()["prompt"]
        assert stop in kept_text and stop not in before  # ends exactly at the token completing the stop string


def test_echo_with_token_ids_adds_no_prompt_text(client):
    """vLLM 0.32 (completion/serving.py): with return_token_ids the echoed prompt text is ""."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 3, "echo": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"].startswith(PROMPT)
    ch = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0]
    assert not ch["text"].startswith(PROMPT) and len(ch["token_ids"]) == 3


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
def test_n_choices_streamed_per_index(client, path, body):
    chat = "chat" in path
    req = {"model": "m", **body, "max_tokens": 8, "n": 3, "return_token_ids": True}
    full = client.post(path, json=req).json()
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert full["usage"]["completion_tokens"] == 24
    ids = [c["token_ids"] for c in full["choices"]]
    assert len({tuple(i) for i in ids}) == 3  # independent samples
    chunks = stream(client, path, req)
    assert chunks[-1]["usage"]["completion_tokens"] == 24 and chunks[-1]["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    body_chunks = chunks[:-1]
    assert all(len(c["choices"]) == 1 for c in body_chunks)
    if chat:
        roles = [c for c in body_chunks if "role" in c["choices"][0]["delta"]]
        assert [c["choices"][0]["index"] for c in roles] == [0, 1, 2] and body_chunks[:3] == roles
        body_chunks = body_chunks[3:]
    for i in range(3):
        mine = [c["choices"][0] for c in body_chunks if c["choices"][0]["index"] == i]
        assert sum((c["token_ids"] for c in mine), []) == ids[i]
        assert [c["finish_reason"] for c in mine][-1] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
        if not chat:
            assert mine[0]["prompt_token_ids"] == full["choices"][i]["prompt_token_ids"]


def test_n_greedy_samples_are_identical_and_best_of_is_ignored(client):
    req = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "n": 2, "temperature": 0, "best_of": 3}
    full = client.post("/v1/completions", json=req).json()
    assert full["choices"][0]["text"] == full["choices"][1]["text"] and full["usage"]["completion_tokens"] == 12


def test_n_below_one_is_rejected(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "n": 0})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_n_samples_share_the_prompt_kv(client):
    """Like vLLM's parallel sampling: the n sequences hit the prompt's blocks in the prefix cache."""

    def hits() -> float:
        line = next(ln for ln in client.get("/metrics").text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total"))
        return float(line.split()[-1])

    prompt = " ".join(f"shared{i}" for i in range(150))
    before = hits()
    r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2, "n": 4}).json()
    full_blocks = r["usage"]["prompt_tokens"] // 16 * 16  # the sim's default block size
    assert full_blocks >= 64 and hits() - before == 3 * full_blocks
