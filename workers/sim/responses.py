"""Response bodies and SSE chunks byte-for-byte in vLLM 0.32's shape (captured from a live server).

Non-streaming bodies are `model_dump_json()` of vLLM's pydantic models: every field, nulls included,
in declaration order. Streaming chunks are `model_dump_json(exclude_unset=True)`: only the fields
vLLM sets, e.g. (completions)

    data: {"id":"cmpl-…","object":"text_completion","created":N,"model":"m","choices":[{"index":0,
           "text":"…","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,
           "token_ids":null}]}

The final content chunk carries `finish_reason` (+ `system_fingerprint` unless a usage chunk follows);
`stream_options.include_usage` adds `{"choices":[],"usage":{…},"system_fingerprint":…}`;
`continuous_usage_stats` adds `usage` to every chunk; chat starts with a role chunk
`{"delta":{"role":"assistant","content":""}}` sent with the first token. Built from pre-rendered
string pieces so one chunk costs a few string joins.

`return_token_ids: true` (captured from vLLM 0.32): every choice's `token_ids` lists the generated ids
(streaming: the ids of that chunk's delta, several when tokens coalesce); the prompt ids go in
`prompt_token_ids` of each completion choice (streaming: only on each index's first chunk) and, for
chat, at the top level of the body (streaming: on each index's role chunk). With `n > 1` the choices
are indexed 0..n-1 and each streamed chunk carries one index.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["Choice", "ChunkWriter", "dumps", "completion_body", "chat_body", "usage_dict"]

SSE_DONE = b"data: [DONE]\n\n"


dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # pydantic's compact JSON


def usage_dict(prompt: int, completion: int, cached: int | None, details: bool) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": (
            {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None} if details else None
        ),
        "completion_tokens_details": None,
    }


class Choice:
    """One finished choice of a non-streaming body: its text, ending and (with `return_token_ids`) ids."""

    __slots__ = ("text", "finish", "stop_reason", "token_ids", "logprobs")

    def __init__(self, text: str, finish: str | None, stop_reason: Any = None, token_ids: list[int] | None = None,
                 logprobs: dict[str, Any] | None = None) -> None:
        self.text, self.finish, self.stop_reason, self.token_ids = text, finish, stop_reason, token_ids
        self.logprobs = logprobs


def _choices(text: str | list[Choice], finish: str | None, stop_reason: Any) -> list[Choice]:
    return text if isinstance(text, list) else [Choice(text, finish, stop_reason)]


def completion_body(rid: str, created: int, model: str, text: str | list[Choice], finish: str | None, stop_reason: Any,
                    usage: dict[str, Any], fingerprint: str, kv_transfer_params: Any = None,
                    choice_extra: dict[str, Any] | None = None, top_extra: dict[str, Any] | None = None,
                    prompt_token_ids: list[int] | None = None) -> str:
    """`text`: the one choice's text, or the list of choices (n > 1, or token ids); `prompt_token_ids` goes
    in every choice (vLLM's `return_token_ids`). `choice_extra` / `top_extra`: fields another engine's
    response adds (TRT-LLM's P/D hand-off)."""
    return _with_extras({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish, "stop_reason": c.stop_reason,
                     "token_ids": c.token_ids, "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids,
                     "routed_experts": None} for i, c in enumerate(_choices(text, finish, stop_reason))],
        "service_tier": None, "system_fingerprint": fingerprint, "usage": usage,
        "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": None,
    }, choice_extra, top_extra)


def _with_extras(body: dict[str, Any], choice_extra: dict[str, Any] | None, top_extra: dict[str, Any] | None) -> str:
    if choice_extra:
        body["choices"][0].update(choice_extra)
    if top_extra:
        body.update(top_extra)
    return dumps(body)


def chat_body(rid: str, created: int, model: str, text: str | list[Choice], finish: str | None, stop_reason: Any,
              usage: dict[str, Any], fingerprint: str, kv_transfer_params: Any = None,
              choice_extra: dict[str, Any] | None = None, top_extra: dict[str, Any] | None = None,
              prompt_token_ids: list[int] | None = None) -> str:
    """Like `completion_body`; chat puts `prompt_token_ids` once, at the top level."""
    def message(content: str) -> dict[str, Any]:
        return {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
                "function_call": None, "reasoning": None}

    return _with_extras({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": message(c.text), "logprobs": c.logprobs, "finish_reason": c.finish,
                     "stop_reason": c.stop_reason, "token_ids": c.token_ids, "routed_experts": None}
                    for i, c in enumerate(_choices(text, finish, stop_reason))],
        "service_tier": None, "system_fingerprint": fingerprint, "usage": usage,
        "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids, "prompt_text": None,
        "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": None,
    }, choice_extra, top_extra)


class ChunkWriter:
    """SSE chunks of one streamed request (completions or chat)."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, fingerprint: str, prompt_tokens: int,
                 include_usage: bool, continuous_usage: bool, cached_tokens: int | None = None,
                 prompt_details: bool = False) -> None:
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.continuous = include_usage and continuous_usage
        self.cached_tokens = cached_tokens
        self.prompt_details = prompt_details
        self.fingerprint = fingerprint
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = f'data: {{"id":{dumps(rid)},"object":"{obj}","created":{created},"model":{dumps(model)},"choices":'
        if chat:
            self._open = '[{"index":0,"delta":{"content":'
            self._mid = '},"logprobs":null,"finish_reason":'
            self._tail_open = ',"token_ids":null}]'
        else:
            self._open = '[{"index":0,"text":'
            self._mid = ',"logprobs":null,"finish_reason":'
            self._tail_open = ',"prompt_token_ids":null,"token_ids":null}]'
        self._usage_extra = ',"completion_tokens_details":null}' if chat else "}"

    def _usage(self, completion: int) -> str:
        p = self.prompt_tokens
        return f',"usage":{{"prompt_tokens":{p},"total_tokens":{p + completion},"completion_tokens":{completion}{self._usage_extra}'

    def role(self, index: int = 0, prompt_token_ids: list[int] | None = None) -> bytes:
        """Chat's first chunk of choice `index`; vLLM puts the prompt ids (return_token_ids) here."""
        usage = self._usage(0) if self.continuous else ""
        prompt = "null" if prompt_token_ids is None else _ids(prompt_token_ids)
        return (self.head + f'[{{"index":{index},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]'
                + usage + f',"prompt_token_ids":{prompt},"prompt_text":null}}\n\n').encode()

    def content(self, text: str, completion_tokens: int, finish: str | None = None, stop_reason: Any = None,
                token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None, index: int = 0,
                logprobs: dict[str, Any] | None = None) -> bytes:
        """One content chunk of choice `index`. `token_ids`: the delta's ids (None: the flag is off);
        `prompt_token_ids`: completions' first chunk of each index under `return_token_ids`."""
        if finish is None:
            fin = 'null,"stop_reason":null' if not self.chat else "null"
        else:
            fin = f'"{finish}","stop_reason":{dumps(stop_reason)}'
        if token_ids is None and prompt_token_ids is None:
            tail = self._tail_open
        elif self.chat:
            tail = f',"token_ids":{_ids(token_ids)}}}]'
        else:
            tail = f',"prompt_token_ids":{_ids(prompt_token_ids)},"token_ids":{_ids(token_ids)}}}]'
        opening = self._open if index == 0 else self._open.replace('"index":0', f'"index":{index}', 1)
        mid = self._mid if logprobs is None else self._mid.replace("null", dumps(logprobs), 1)
        s = self.head + opening + dumps(text) + mid + fin + tail
        if self.continuous:
            s += self._usage(completion_tokens)
        if finish is not None and not self.include_usage:
            s += f',"system_fingerprint":{dumps(self.fingerprint)}'
        return (s + "}\n\n").encode()

    def usage(self, completion_tokens: int) -> bytes:
        p = self.prompt_tokens
        details = ""
        if self.prompt_details and self.cached_tokens is not None:
            details = f',"prompt_tokens_details":{{"cached_tokens":{self.cached_tokens}}}'
        return (self.head + f'[],"usage":{{"prompt_tokens":{p},"total_tokens":{p + completion_tokens},'
                f'"completion_tokens":{completion_tokens}{details}}},"system_fingerprint":{dumps(self.fingerprint)}}}\n\n').encode()


def _ids(ids: list[int] | None) -> str:
    return "null" if ids is None else "[" + ",".join(map(str, ids)) + "]"
