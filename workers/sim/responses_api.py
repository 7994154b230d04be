"""The sim's `/v1/responses` (create, stream, retrieve, cancel) and `/v1/embeddings`, in vLLM 0.32's shapes.

Responses (vllm/entrypoints/openai/responses/): the input (a string, or a list of message items whose content
is a string or `input_text` / `output_text` parts), after `instructions` as a system message and after the
stored conversation of `previous_response_id`, goes through the chat template and runs on the engine like a chat
request; the answer is one `message` output item. Stored in memory (as vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1,
which kvyard's vLLM backend sets), bounded to MAX_STORED (the oldest dropped first); an unknown id is vLLM's 404
`Response with id '<id>' not found.`. Streaming sends vLLM's simple-text event sequence as `event: <type>` /
`data: <json>` pairs (no [DONE]): response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, response.completed. Tools, reasoning, background mode: not simulated (400).

Embeddings (vllm/entrypoints/pooling/embed/): served when the sim runs as a pooling model (`--runner pooling`,
as vLLM); each input (a string, a list of strings, token ids, or lists of them) becomes one unit-length vector of
EMBED_DIM floats derived from its token ids (the same input, the same vector), as `float` lists or `base64`
little-endian float32 (what the openai client asks for by default).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import struct
import time
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from workers.sim.protocol import ApiError, bad_request, parse_body
from workers.sim.server import SimState, error_response

__all__ = ["create_response", "retrieve_response", "cancel_response", "embeddings", "EMBED_DIM", "MAX_STORED"]

EMBED_DIM = 64
MAX_STORED = 10_000
_counter = itertools.count()
_SSE_HEADERS = {"cache-control": "no-cache"}


class _ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None


class _EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


def _store(st: SimState) -> OrderedDict:
    store = getattr(st, "_responses", None)
    if store is None:
        store = OrderedDict()  # id -> (response dict, the conversation's messages incl. the answer)
        st._responses = store  # type: ignore[attr-defined]
    return store


def _not_found(response_id: str) -> ApiError:
    return ApiError(f"Response with id '{response_id}' not found.", "invalid_request_error", 404, "response_id")


def _item_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text"))
    raise bad_request("Unsupported input item content.", "input")


def _messages(body: _ResponsesBody, previous: list[dict[str, str]]) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": body.instructions}] if body.instructions else []
    msgs += previous
    if isinstance(body.input, str):
        msgs.append({"role": "user", "content": body.input})
    else:
        for item in body.input:
            if item.get("type", "message") != "message" or item.get("role") not in ("user", "assistant", "system", "developer"):
                raise bad_request("Only message input items are supported by the kvyard sim engine.", "input")
            msgs.append({"role": item["role"], "content": _item_text(item.get("content"))})
    return msgs


def _response(rid: str, created: int, body: _ResponsesBody, model: str, max_tokens: int, status: str, text: str | None,
              msg_id: str, usage: dict | None, incomplete: str | None = None) -> dict[str, Any]:
    output = [] if text is None else [{"id": msg_id, "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
                                       "role": "assistant", "status": "completed", "type": "message", "phase": None}]
    return {
        "id": rid, "created_at": created, "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions, "metadata": body.metadata, "model": model, "object": "response", "output": output,
        "parallel_tool_calls": True, "temperature": 1.0 if body.temperature is None else body.temperature, "tool_choice": "none",
        "tools": [], "top_p": 1.0 if body.top_p is None else body.top_p, "background": False, "max_output_tokens": max_tokens,
        "max_tool_calls": None, "previous_response_id": body.previous_response_id, "prompt": None, "reasoning": None,
        "service_tier": "auto", "status": status, "text": None, "top_logprobs": None, "truncation": "disabled", "usage": usage,
        "user": body.user, "presence_penalty": 0.0, "frequency_penalty": 0.0, "kv_transfer_params": None,
        "ec_transfer_params": None, "input_messages": None, "output_messages": None,
    }  # fmt: skip


def _usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                                             "cached_tokens_per_turn": []},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                                               "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + output}


async def create_response(request: Request) -> Response:
    from workers.sim.generate import _SSEResponse, _check_prompt_len, _effective_max_tokens, _wait_disconnect

    st: SimState = request.app.state.sim
    try:
        body = parse_body(await request.body(), _ResponsesBody)
        st.check_model(body.model)
        if body.tools:
            raise bad_request("Tools are not supported by the kvyard sim engine.", "tools")
        if body.background:
            raise bad_request("Background mode is not supported by the kvyard sim engine.", "background")
        previous: list[dict[str, str]] = []
        if body.previous_response_id is not None:
            prev = _store(st).get(body.previous_response_id)
            if prev is None:
                raise _not_found(body.previous_response_id)
            previous = [m for m in prev[1] if m["role"] != "system"]  # instructions are not carried over (OpenAI, vLLM)
        msgs = _messages(body, previous)
        text = st.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        ids = st.tokenizer.encode(text, add_special_tokens=False)
        _check_prompt_len(st, len(ids), from_text=True)
        max_tokens = _effective_max_tokens(st, body.max_output_tokens, len(ids), 0)
    except ApiError as err:
        return error_response(err, st.cfg.flavor)
    rid = f"resp_{uuid.uuid4().hex}"
    msg_id = f"msg_{uuid.uuid4().hex}"
    created = int(time.time())
    model = st.cfg.model_name
    key = f"{rid}-{next(_counter)}"
    st.server_load += 1
    stream = st.engine.submit(key, ids, max_tokens, st.text.source(ids, 0), arrival=st.engine.clock())
    out: list[int] = []

    def finish(finish_reason: str | None) -> dict[str, Any]:
        answer = st.text.text(out)
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        resp = _response(rid, created, body, model, max_tokens, "incomplete" if incomplete else "completed", answer, msg_id,
                         _usage(len(ids), len(out), max(stream.req.num_cached_tokens, 0)), incomplete)
        if body.store is not False:
            store = _store(st)
            store[rid] = (resp, msgs + [{"role": "assistant", "content": answer}])
            while len(store) > MAX_STORED:
                store.popitem(last=False)
        return resp

    if body.stream:
        seq = itertools.count()
        state = {"stage": 0, "text": ""}

        def ev(kind: str, **fields: Any) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **fields}, separators=(',', ':'))}\n\n".encode()

        async def produce() -> bytes | None:
            if state["stage"] == 2:
                return None
            parts = []
            if state["stage"] == 0:
                state["stage"] = 1
                shell = _response(rid, created, body, model, max_tokens, "in_progress", None, msg_id, None)
                parts += [ev("response.created", response=shell), ev("response.in_progress", response=shell),
                          ev("response.output_item.added", output_index=0,
                             item={"id": msg_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message", "phase": None}),
                          ev("response.content_part.added", output_index=0, item_id=msg_id, content_index=0,
                             part={"annotations": [], "text": "", "type": "output_text", "logprobs": []})]
            toks, finish_reason = await stream.next()
            if toks:
                before = state["text"]
                out.extend(toks)
                state["text"] = st.text.text(out)
                parts.append(ev("response.output_text.delta", content_index=0, delta=state["text"][len(before):], item_id=msg_id,
                                logprobs=[], output_index=0))
            if finish_reason is not None:
                state["stage"] = 2
                resp = finish(finish_reason)
                part = {"annotations": [], "text": resp["output"][0]["content"][0]["text"], "type": "output_text", "logprobs": None}
                parts += [ev("response.output_text.done", content_index=0, item_id=msg_id, logprobs=[], output_index=0, text=part["text"]),
                          ev("response.content_part.done", content_index=0, item_id=msg_id, output_index=0, part=part),
                          ev("response.output_item.done", output_index=0, item=resp["output"][0]),
                          ev("response.completed", response=resp)]
            return b"".join(parts)

        def on_end() -> None:
            st.engine.abort(key)
            st.server_load -= 1

        return _SSEResponse(produce, lambda: st.engine.abort(key), on_end)

    async def collect() -> str | None:
        while True:
            toks, finish_reason = await stream.next()
            out.extend(toks)
            if finish_reason is not None:
                return finish_reason

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            st.engine.abort(key)
            return Response(status_code=499)
        return JSONResponse(finish(work.result()))
    finally:
        gone.cancel()
        st.server_load -= 1


async def retrieve_response(request: Request) -> Response:
    st: SimState = request.app.state.sim
    rid = request.path_params["response_id"]
    stored = _store(st).get(rid)
    if stored is None:
        return error_response(_not_found(rid), st.cfg.flavor)
    return JSONResponse(stored[0])


async def cancel_response(request: Request) -> Response:
    """vLLM cancels background responses only; a finished one is a 400."""
    st: SimState = request.app.state.sim
    rid = request.path_params["response_id"]
    if rid not in _store(st):
        return error_response(_not_found(rid), st.cfg.flavor)
    return error_response(ApiError("Cannot cancel a synchronous response.", "invalid_request_error", 400), st.cfg.flavor)


def _vector(ids: list[int]) -> list[float]:
    seed = hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).digest()
    raw = b"".join(hashlib.sha256(seed + bytes([i])).digest() for i in range((EMBED_DIM * 2 + 31) // 32))
    v = [(int.from_bytes(raw[2 * i:2 * i + 2], "little") / 32767.5) - 1.0 for i in range(EMBED_DIM)]
    norm = sum(x * x for x in v) ** 0.5 or 1.0
    return [x / norm for x in v]


async def embeddings(request: Request) -> Response:
    st: SimState = request.app.state.sim
    try:
        body = parse_body(await request.body(), _EmbeddingsBody)
        st.check_model(body.model)
        if body.encoding_format not in ("float", "base64"):
            raise bad_request(f"encoding_format must be float or base64, got {body.encoding_format!r}.", "encoding_format")
        inp = body.input
        if isinstance(inp, str) or (isinstance(inp, list) and inp and isinstance(inp[0], int)):
            inputs: list = [inp]
        else:
            inputs = list(inp)
        if not inputs or any(x in ("", []) for x in inputs):
            raise bad_request("Input must not be empty.", "input")
        id_lists = [st.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]
        for ids in id_lists:
            if len(ids) > st.cfg.max_model_len:
                raise bad_request(f"This model's maximum context length is {st.cfg.max_model_len} tokens. However, you requested "
                                  f"{len(ids)} tokens in the input for embedding generation. Please reduce the length of the input.",
                                  "input_tokens", len(ids))
    except ApiError as err:
        return error_response(err, st.cfg.flavor)
    data = []
    for i, ids in enumerate(id_lists):
        vec = _vector(ids)
        emb: Any = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if body.encoding_format == "base64" else vec
        data.append({"index": i, "object": "embedding", "embedding": emb})
    n = sum(len(ids) for ids in id_lists)
    return JSONResponse({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": st.cfg.model_name,
                         "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None,
                                   "completion_tokens_details": None}})
