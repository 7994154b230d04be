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
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ChunkWriter", "dumps", "completion_body", "chat_body", "usage_dict"]

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


def completion_body(rid: str, created: int, model: str, text: str, finish: str | None, stop_reason: Any,
                    usage: dict[str, Any], fingerprint: str, kv_transfer_params: Any = None) -> str:
    return dumps({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
                     "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": fingerprint, "usage": usage,
        "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": None,
    })


def chat_body(rid: str, created: int, model: str, text: str, finish: str | None, stop_reason: Any,
              usage: dict[str, Any], fingerprint: str, kv_transfer_params: Any = None) -> str:
    message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "reasoning": None}
    return dumps({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                     "stop_reason": stop_reason, "token_ids": None, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": fingerprint, "usage": usage,
        "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
        "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": None,
    })


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

    def role(self) -> bytes:
        usage = self._usage(0) if self.continuous else ""
        return (self.head + '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
                + usage + ',"prompt_token_ids":null,"prompt_text":null}\n\n').encode()

    def content(self, text: str, completion_tokens: int, finish: str | None = None, stop_reason: Any = None) -> bytes:
        if finish is None:
            fin = 'null,"stop_reason":null' if not self.chat else "null"
        else:
            fin = f'"{finish}","stop_reason":{dumps(stop_reason)}'
        s = self.head + self._open + dumps(text) + self._mid + fin + self._tail_open
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
