"""Responses and SSE chunks are byte-identical to vLLM 0.32's (golden captures), given the same values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.sim.protocol import ApiError, CompletionRequest, bad_request, parse_body
from workers.sim.responses import ChunkWriter, chat_body, completion_body, usage_dict

HTTP = json.loads((Path(__file__).resolve().parents[3] / "fixtures" / "vllm" / "http.json").read_text())


def events(name: str) -> list[str]:
    body = HTTP[name]["body"]
    return [e + "\n\n" for e in body.split("\n\n") if e]


@pytest.mark.parametrize("name,builder", [("completion", completion_body), ("chat", chat_body)])
def test_non_streaming_body_is_byte_identical(name, builder):
    ref = json.loads(HTTP[name]["body"])
    ch = ref["choices"][0]
    text = ch["text"] if name == "completion" else ch["message"]["content"]
    u = ref["usage"]
    usage = usage_dict(u["prompt_tokens"], u["completion_tokens"], None, details=False)
    got = builder(ref["id"], ref["created"], ref["model"], text, ch["finish_reason"], ch["stop_reason"], usage, ref["system_fingerprint"])
    assert got == HTTP[name]["body"]


@pytest.mark.parametrize("name", ["completion_stream", "completion_stream_usage", "chat_stream", "chat_stream_usage"])
def test_stream_chunks_are_byte_identical(name):
    evs = events(name)
    assert evs[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in evs[:-1]]
    chat = name.startswith("chat")
    with_usage = name.endswith("_usage")
    first = chunks[0]
    fingerprint = next((c["system_fingerprint"] for c in chunks if "system_fingerprint" in c), "")
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"] if with_usage else 0
    w = ChunkWriter(chat, first["id"], first["created"], first["model"], fingerprint, prompt_tokens, with_usage, False)
    got: list[bytes] = []
    n = 0
    for c in chunks:
        if not c["choices"]:
            got.append(w.usage(c["usage"]["completion_tokens"]))
            continue
        choice = c["choices"][0]
        if chat and "role" in choice["delta"]:
            got.append(w.role())
            continue
        n += 1
        text = choice["delta"]["content"] if chat else choice["text"]
        got.append(w.content(text, n, choice["finish_reason"], choice.get("stop_reason")))
    assert [g.decode() for g in got] == evs[:-1]


def test_continuous_usage_chunks():
    w = ChunkWriter(True, "chatcmpl-x", 1, "m", "fp", 16, True, True)
    assert w.role().decode() == (
        'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
        '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":16,'
        '"total_tokens":16,"completion_tokens":0,"completion_tokens_details":null},"prompt_token_ids":null,"prompt_text":null}\n\n'
    )
    w2 = ChunkWriter(False, "cmpl-x", 1, "m", "fp", 2, True, True, cached_tokens=0, prompt_details=True)
    assert w2.content(" a", 1).decode().endswith('"token_ids":null}],"usage":{"prompt_tokens":2,"total_tokens":3,"completion_tokens":1}}\n\n')
    assert '"prompt_tokens_details":{"cached_tokens":0}},"system_fingerprint":"fp"}' in w2.usage(1).decode()


def test_control_characters_escape_like_pydantic():
    w = ChunkWriter(False, "cmpl-x", 1, "m", "fp", 0, False, False)
    assert '"text":"\\u0016\\b\\n\\"é"' in w.content('\x16\b\n"é', 1).decode()


@pytest.mark.parametrize(
    "raw,err_type,param,starts",
    [
        (b'{"model":', "Bad Request", "body.9", "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.9'"),
        (b'{"prompt":"x","max_tokens":"abc"}', "Bad Request", "body.max_tokens", "1 validation error:\n  {'type': 'int_parsing'"),
    ],
)
def test_schema_errors_like_vllm(raw, err_type, param, starts):
    with pytest.raises(ApiError) as info:
        parse_body(raw, CompletionRequest)
    err = info.value.body()["error"]
    assert (err["type"], err["param"], err["code"]) == (err_type, param, 400) and err["message"].startswith(starts)


def test_bad_request_message_suffix_like_vllm_validation_error():
    assert bad_request("max_tokens must be at least 1, got -1.", "max_tokens", -1).body() == json.loads(HTTP["error_bad_max_tokens"]["body"])
