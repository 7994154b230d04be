"""`/v1/completions` and `/v1/chat/completions`: validate like vLLM, submit to the engine, stream back.

Check order (vLLM 0.32): body schema -> model (404) -> n / logprobs -> `max_tokens > max_model_len`
-> prompt length (`> max_model_len`) -> effective `max_tokens = min(requested, max_model_len - prompt)`
(default: 16 for completions, `max_model_len - prompt` for chat) must be >= 1 -> sampling checks.
Request id: `X-Request-Id` header, else body `request_id`, else 16 random hex; the response id is
`cmpl-<id>` / `chatcmpl-<id>`. Stop strings are matched on the output text once `min_tokens` are out
(no hold-back: a stop string split across chunks may already be partly streamed); the text is cut
at the match, `finish_reason="stop"`, `stop_reason=<the string>`, and the engine request is aborted.
A client disconnect (streaming or not) aborts the engine request and frees its blocks.
Arrival is taken when the handler starts: the profile's TTFT is what a client measured against vLLM
(HTTP, tokenization and hashing included), so the sim's own request processing is not added on top.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from workers.sim.engine import RequestStream
from workers.sim.protocol import ApiError, ChatCompletionRequest, CompletionRequest, bad_request, parse_body, validate_sampling
from workers.sim.responses import SSE_DONE, ChunkWriter, chat_body, completion_body, usage_dict
from workers.sim.server import SimState, error_response
from workers.sim.text import TextSource

__all__ = ["completions", "chat_completions"]

_counter = itertools.count()
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


def _base_id(request: Request, body_id: str | None) -> str:
    return request.headers.get("x-request-id") or body_id or f"{uuid.uuid4().int & (2**64 - 1):016x}"


def _check_max_tokens(requested: int | None, param: str, max_model_len: int) -> None:
    if requested is not None and requested > max_model_len:
        raise bad_request(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens.",
            param, requested,
        )


def _check_prompt_len(st: SimState, n: int, from_text: bool) -> None:
    m = st.cfg.max_model_len
    if n > m:
        count = m + 1 if from_text else n  # vLLM tokenizes text with truncation at max_model_len + 1
        qualifier = "at least " if count == m + 1 else ""
        raise bad_request(
            f"This model's maximum context length is {m} tokens. However, your prompt contains {qualifier}{count} "
            "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens", count,
        )


def _effective_max_tokens(st: SimState, requested: int | None, prompt_len: int, min_tokens: int) -> int:
    value = st.cfg.max_model_len - prompt_len if requested is None else min(requested, st.cfg.max_model_len - prompt_len)
    if value < 1:
        raise bad_request(f"max_tokens must be at least 1, got {value}.", "max_tokens", value)
    if min_tokens > value:
        raise bad_request(f"min_tokens must be less than or equal to max_tokens={value}, got {min_tokens}.")
    return value


class _Output:
    """Accumulated output text with stop-string matching."""

    def __init__(self, text: TextSource, stops: list[str], include_stop: bool, min_tokens: int) -> None:
        self.src, self.stops, self.include_stop, self.min_tokens = text, stops, include_stop, min_tokens
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.n_tokens = 0
        self.stop_hit: str | None = None

    def add(self, toks: list[int]) -> str:
        new = self.src.text(toks)
        self.n_tokens += len(toks)
        if self.stops and self.n_tokens >= self.min_tokens:
            full = self.text + new
            start = max(0, len(self.text) - self.longest + 1)
            best: tuple[int, str] | None = None
            for s in self.stops:
                i = full.find(s, start)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                cut = best[0] + (len(best[1]) if self.include_stop else 0)
                delta = full[len(self.text):cut] if cut > len(self.text) else ""
                self.text, self.stop_hit = full[:cut], best[1]
                return delta
        self.text += new
        return new


async def _wait_disconnect(receive: Callable[[], Any]) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class _SSEResponse:
    """A minimal ASGI SSE response that aborts the engine request when the client goes away.

    `produce()` returns the bytes of the next engine output (one or more SSE events) or None at the
    end; events produced together (role + first content, last content + usage + [DONE]) go out in one
    write, byte-identical to vLLM's separate writes on the wire.
    """

    def __init__(self, produce: Callable[[], Awaitable[bytes | None]], on_disconnect: Callable[[], None],
                 on_end: Callable[[], None]) -> None:
        self.produce, self.on_disconnect, self.on_end = produce, on_disconnect, on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watch() -> None:
            await _wait_disconnect(receive)
            self.on_disconnect()

        watcher = asyncio.ensure_future(watch())
        produce = self.produce
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            while (chunk := await produce()) is not None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            self.on_disconnect()
        finally:
            watcher.cancel()
            self.on_end()


async def _generate(st: SimState, request: Request, chat: bool, rid: str, body: Any, prompt_ids: list[int], max_tokens: int,
                    echo_text: str | None, arrival: float) -> Any:
    engine = st.engine
    key = f"{rid}-{next(_counter)}"
    stream: RequestStream = engine.submit(
        key, prompt_ids, max_tokens, st.text.source(prompt_ids), min_tokens=body.min_tokens,
        stop_token_ids=body.stop_token_ids or (), arrival=arrival,
    )
    out = _Output(st.text, body.stop_list(), body.include_stop_str_in_output, body.min_tokens)
    created = int(time.time())
    model = st.cfg.model_name
    details = st.cfg.enable_prompt_tokens_details

    async def next_piece() -> tuple[str, str | None, Any]:
        toks, finish = await stream.next()
        delta = out.add(toks)
        if out.stop_hit is not None:
            engine.abort(key, "stop")
            return delta, "stop", out.stop_hit
        return delta, finish, stream.req.stop_reason

    if body.stream:
        opts = body.stream_options
        writer = ChunkWriter(chat, rid, created, model, st.fingerprint, len(prompt_ids),
                             bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats),
                             prompt_details=details)

        state = {"first": True, "done": False}

        async def produce() -> bytes | None:
            if state["done"]:
                return None
            delta, finish, stop_reason = await next_piece()
            parts = []
            if state["first"]:
                state["first"] = False
                writer.cached_tokens = max(stream.req.num_cached_tokens, 0)
                if chat:
                    parts.append(writer.role())
                elif echo_text is not None:
                    delta = echo_text + delta
            parts.append(writer.content(delta, out.n_tokens, finish, stop_reason))
            if finish is not None:
                state["done"] = True
                if writer.include_usage:
                    parts.append(writer.usage(out.n_tokens))
                parts.append(SSE_DONE)
            return parts[0] if len(parts) == 1 else b"".join(parts)

        def on_end() -> None:
            engine.abort(key)  # no-op when the request already finished
            st.server_load -= 1

        return _SSEResponse(produce, lambda: engine.abort(key), on_end)

    collect = asyncio.ensure_future(_collect(next_piece))
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:
            collect.cancel()
            engine.abort(key)
            return Response(status_code=499)
        finish, stop_reason = collect.result()
    finally:
        watcher.cancel()
        st.server_load -= 1
    cached = max(stream.req.num_cached_tokens, 0)
    usage = usage_dict(len(prompt_ids), out.n_tokens, cached, details)
    text = out.text if echo_text is None else echo_text + out.text
    build = chat_body if chat else completion_body
    return Response(build(rid, created, model, text, finish, stop_reason, usage, st.fingerprint, None), media_type="application/json")


async def _collect(next_piece: Callable[[], Any]) -> tuple[str | None, Any]:
    while True:
        _delta, finish, stop_reason = await next_piece()
        if finish is not None:
            return finish, stop_reason


async def completions(request: Request) -> Any:
    st: SimState = request.app.state.sim
    st.server_load += 1
    arrival = st.engine.clock()
    try:
        body = parse_body(await request.body(), CompletionRequest)
        st.check_model(body.model)
        validate_sampling(body)
        _check_max_tokens(body.max_tokens, "max_tokens", st.cfg.max_model_len)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request("Several prompts in one request are not supported by the kvyard sim engine.", "prompt")
            prompt = prompt[0]
        if prompt is None or prompt == "" or prompt == []:
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            ids = st.tokenizer.encode(prompt)
            _check_prompt_len(st, len(ids), from_text=True)
        else:
            ids = list(prompt)
            _check_prompt_len(st, len(ids), from_text=False)
        max_tokens = _effective_max_tokens(st, body.max_tokens if body.max_tokens is not None else 16, len(ids), body.min_tokens)
        echo = (prompt if isinstance(prompt, str) else st.tokenizer.decode(ids)) if body.echo else None
        rid = "cmpl-" + _base_id(request, body.request_id)
        return await _generate(st, request, False, rid, body, ids, max_tokens, echo, arrival)
    except ApiError as err:
        st.server_load -= 1
        return error_response(err)


def _messages_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        out.append({**m, "content": content if content is not None else ""})
    return out


async def chat_completions(request: Request) -> Any:
    st: SimState = request.app.state.sim
    st.server_load += 1
    arrival = st.engine.clock()
    try:
        body = parse_body(await request.body(), ChatCompletionRequest)
        st.check_model(body.model)
        validate_sampling(body)
        requested, param = body.requested_max_tokens()
        _check_max_tokens(requested, param, st.cfg.max_model_len)
        try:
            text = st.tokenizer.apply_chat_template(
                _messages_text(body.messages), add_generation_prompt=body.add_generation_prompt, **(body.chat_template_kwargs or {})
            )
        except Exception as exc:  # template errors are the client's fault
            raise bad_request(f"Failed to apply the chat template: {exc}") from exc
        ids = st.tokenizer.encode(text, add_special_tokens=False)
        _check_prompt_len(st, len(ids), from_text=True)
        max_tokens = _effective_max_tokens(st, requested, len(ids), body.min_tokens)
        rid = "chatcmpl-" + _base_id(request, body.request_id)
        return await _generate(st, request, True, rid, body, ids, max_tokens, None, arrival)
    except ApiError as err:
        st.server_load -= 1
        return error_response(err)
