"""`/v1/completions` and `/v1/chat/completions`: validate like vLLM, submit to the engine, stream back.

Check order (vLLM 0.32): body schema -> model (404) -> n / logprobs -> `max_tokens > max_model_len`
-> prompt length (`> max_model_len`) -> effective `max_tokens = min(requested, max_model_len - prompt)`
(default: 16 for completions, `max_model_len - prompt` for chat) must be >= 1 -> sampling checks.
Request id: `X-Request-Id` header, else body `request_id`, else 16 random hex; the response id is
`cmpl-<id>` / `chatcmpl-<id>`. Stop strings are matched on the output text once `min_tokens` are out
(no hold-back: a stop string split across chunks may already be partly streamed); the text is cut
at the match, `finish_reason="stop"`, `stop_reason=<the string>`, and the engine request is aborted.
A client disconnect (streaming or not) aborts the engine request and frees its blocks.
`n > 1`: n engine requests on the same prompt (the later ones hit its blocks in the prefix cache, as
vLLM's parallel samples do), each with its own output sequence (`temperature: 0`: all the same);
choices 0..n-1, one choice per streamed chunk, usage over all of them; `best_of` is ignored (vLLM V1).
`return_token_ids` (vLLM flavor): each chunk lists all the ids of its delta, however many coalesced.
Arrival is taken when the handler starts: the profile's TTFT is what a client measured against vLLM
(HTTP, tokenization and hashing included), so the sim's own request processing is not added on top.

LoRA: a request whose `model` is a loaded adapter (SGLang flavor: `lora_path` names it) runs on it
(workers/sim/adapters.py). Chat image/audio parts become placeholder runs (workers/multimodal.py: the frontend
places them the same way), charged as prompt tokens and keyed in the cache by each item's identifier; any
other part type is a 400.

P/D hand-offs (workers/sim/disagg.py) hook in here: the request's role comes from its body
(`DisaggRuntime.classify`); a prefill's non-streaming response carries the flavor's hand-off fields;
a decode whose KV load failed answers 500 (streaming: an error event, then [DONE]) like vLLM's
GenerationError; a vLLM decode refused before reaching the engine still frees its prefill's blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from workers.multimodal import ContentError, flatten_messages, tokenize_mm_chat
from workers.sim.disagg import Handoff
from workers.sim.engine import RequestStream
from workers.sim.logprobs import Logprobs
from workers.sim.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    logprobs_k,
    parse_body,
    validate_sampling,
)
from workers.sim.responses import SSE_DONE, Choice, ChunkWriter, chat_body, completion_body, usage_dict
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
    """Accumulated output text and token ids of one choice, with stop-string matching."""

    def __init__(self, text: TextSource, stops: list[str], include_stop: bool, min_tokens: int) -> None:
        self.src, self.stops, self.include_stop, self.min_tokens = text, stops, include_stop, min_tokens
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.ids: list[int] = []
        self.stop_hit: str | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def add(self, toks: list[int]) -> tuple[str, list[int]]:
        """New tokens (several when the reader lagged) -> (text delta, the ids of that delta).

        On a stop string the tokens after the one that completed it are dropped, as vLLM stops
        there (they exist only because the sim coalesced several steps into one read)."""
        new = self.src.text(toks)
        if self.stops and len(self.ids) + len(toks) >= self.min_tokens:
            full = self.text + new
            start = max(0, len(self.text) - self.longest + 1)
            best: tuple[int, str] | None = None
            for s in self.stops:
                i = full.find(s, start)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                end = best[0] + len(best[1])  # the token holding the match's last character ends the output
                pos, kept = len(self.text), 0
                strings = self.src.strings
                while kept < len(toks) and pos < end:
                    pos += len(strings[toks[kept]])
                    kept += 1
                toks = toks[:max(kept, 1)]
                cut = best[0] + (len(best[1]) if self.include_stop else 0)
                delta = full[len(self.text):cut] if cut > len(self.text) else ""
                self.text, self.stop_hit = full[:cut], best[1]
                self.ids.extend(toks)
                return delta, toks
        self.text += new
        self.ids.extend(toks)
        return new, toks


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


def _handoff(st: SimState, body: Any) -> Handoff | None:
    """The request's P/D role under this sim's flavor (None: a plain request); 400 on missing fields."""
    if st.disagg is None:
        return None
    fields = dict(body.model_extra or {})
    fields["kv_transfer_params"] = body.kv_transfer_params
    h = st.disagg.classify(fields)
    if isinstance(h, list):
        raise bad_request(f"Missing or invalid disaggregation fields: {', '.join(h)}.", h[0].split(" ")[0])
    return h


def _load_error(st: SimState, h: Handoff | None) -> ApiError:
    """A decode whose KV never arrived: vLLM raises GenerationError("Internal server error") (500)."""
    detail = h.remote.error if h is not None and h.remote is not None else None
    message = "Internal server error" if st.cfg.flavor == "vllm" or not detail else f"KV transfer failed: {detail}"
    return ApiError(message, "InternalServerError", 500)


def _cached_tokens(stream: RequestStream, h: Handoff | None) -> int:
    """Prompt tokens reported as cached. vLLM 0.32 reports a remote-prefilled request's cache hits as the
    prefill's (`remote_prefill_cached_tokens`, output_processor.py), not its own ~100% hit from the transfer."""
    if h is not None and h.role == "decode" and h.remote_cached_tokens is not None:
        return h.remote_cached_tokens
    return max(stream.req.num_cached_tokens, 0)


def _reject_cleanup(st: SimState, body: Any) -> None:
    """vLLM `_with_kv_transfer_rejection_cleanup`: a decode refused before the engine frees its prefill's blocks."""
    params = getattr(body, "kv_transfer_params", None) if body is not None else None
    if st.disagg is not None and st.cfg.flavor == "vllm" and isinstance(params, dict) and params.get("do_remote_prefill"):
        st.disagg.notify_rejected(params)


async def _wait_any(streams: list[RequestStream]) -> None:
    """Wait until one of several streams has output."""
    waits = [asyncio.ensure_future(s.wait()) for s in streams]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _generate(st: SimState, request: Request, chat: bool, rid: str, body: Any, prompt_ids: list[int], max_tokens: int,
                    echo_text: str | None, arrival: float, handoff: Handoff | None = None, lora: tuple[str, str] | None = None,
                    mm_items: tuple = (), batch: list[tuple[list[int], str | None, int]] = ()) -> Any:
    """Run the request's `n` sequences (one engine request each, sharing the prompt's KV through the
    prefix cache like vLLM's parallel sampling) and answer in one body or as SSE chunks. `batch`: the further
    prompts of a batched completion, (ids, echo text, max_tokens) each; choice p * n + i is prompt p's sample i."""
    engine = st.engine
    n = body.n
    if (n > 1 or batch) and handoff is not None:
        raise bad_request("n > 1 is not supported on a P/D hand-off by the kvyard sim engine.", "n", n)
    prompts = [(prompt_ids, echo_text, max_tokens), *batch]
    key = f"{rid}-{next(_counter)}"
    keys = [key] if n == 1 and not batch else [f"{key}-{j}" for j in range(n * len(prompts))]
    h = handoff
    if h is not None and h.role == "decode" and h.remote is not None and h.remote.state == "failed" and h.remote.recompute_on_failure:
        h = None  # vLLM, invalid params under kv_load_failure_policy=recompute: a plain local prefill
    if h is not None and h.max_tokens is not None:
        prompts[0] = (prompt_ids, echo_text, min(max_tokens, h.max_tokens))
    greedy = body.temperature == 0  # greedy samples are all the same sequence
    streams: list[RequestStream] = [
        engine.submit(
            k, prompts[j // n][0], prompts[j // n][2], st.text.source(prompts[j // n][0], 0 if greedy else j % n),
            min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids or (), arrival=arrival,
            hold_blocks=h is not None and h.role == "prefill", remote=h.remote if h is not None and h.role == "decode" else None,
            lora=lora, mm_items=mm_items,
        )
        for j, k in enumerate(keys)
    ]
    stream = streams[0]
    if h is not None:
        assert st.disagg is not None
        st.disagg.submitted(key, h)
    outs = [_Output(st.text, body.stop_list(), body.include_stop_str_in_output, body.min_tokens) for _ in keys]
    want_ids = bool(body.return_token_ids) and st.cfg.flavor == "vllm"  # a vLLM field; the other engines ignore it
    if want_ids:  # vLLM 0.32: with return_token_ids, echo adds no prompt text
        prompts = [(ids, None if echo is None else "", mt) for ids, echo, mt in prompts]
    echoes = [echo for _, echo, _ in prompts]
    k = logprobs_k(body)
    tok = st.tokenizer
    lps = None if k is None else [Logprobs(lambda t: tok.decode([t], skip_special_tokens=False), tok.vocab_size, k, chat) for _ in keys]
    prompt_list = list(prompt_ids) if want_ids else None
    prompt_tokens = sum(len(ids) for ids, _, _ in prompts)
    created = int(time.time())
    model = st.cfg.model_name
    details = st.cfg.enable_prompt_tokens_details

    async def next_piece(i: int) -> tuple[str, list[int], str | None, Any]:
        toks, finish = await streams[i].next()
        out = outs[i]
        delta, ids = out.add(toks)
        if out.stop_hit is not None:
            engine.abort(keys[i], "stop")
            return delta, ids, "stop", out.stop_hit
        return delta, ids, finish, streams[i].req.stop_reason

    def abort_all() -> None:
        for k in keys:
            engine.abort(k)  # no-op when the request already finished

    if body.stream:
        opts = body.stream_options
        writer = ChunkWriter(chat, rid, created, model, st.fingerprint, prompt_tokens,
                             bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats),
                             prompt_details=details)
        active = list(range(len(keys)))
        started = [False] * len(keys)
        state = {"first": True, "done": False}

        async def produce() -> bytes | None:
            if state["done"]:
                return None
            if len(keys) == 1:
                ready = active  # next() waits
            else:
                ready = [i for i in active if streams[i].ready]
                if not ready:
                    await _wait_any([streams[i] for i in active])
                    ready = [i for i in active if streams[i].ready]
            parts = []
            for i in list(ready):
                delta, ids, finish, stop_reason = await next_piece(i)
                if finish == "error":  # vLLM: the GenerationError as an SSE error event, then [DONE]
                    state["done"] = True
                    err = _load_error(st, h).body(st.cfg.flavor)
                    return f"data: {json.dumps(err)}\n\n".encode() + SSE_DONE
                if state["first"]:
                    state["first"] = False
                    writer.cached_tokens = _cached_tokens(stream, h)
                    if chat:  # vLLM sends every choice's role chunk before the first content
                        parts.extend(writer.role(j, prompt_list) for j in range(n))
                prompt_first = None
                if not started[i]:
                    started[i] = True
                    if not chat:
                        prompt_first = list(prompts[i // n][0]) if want_ids else None
                        if echoes[i // n] is not None:
                            delta = echoes[i // n] + delta
                parts.append(writer.content(delta, outs[i].n_tokens, finish, stop_reason, ids if want_ids else None,
                                            prompt_first, index=i, logprobs=lps[i].of(ids) if lps else None))
                if finish is not None:
                    active.remove(i)
            if not active:
                state["done"] = True
                if writer.include_usage:
                    parts.append(writer.usage(sum(o.n_tokens for o in outs)))
                parts.append(SSE_DONE)
            return parts[0] if len(parts) == 1 else b"".join(parts)

        def on_end() -> None:
            abort_all()
            st.server_load -= 1
            if st.disagg is not None:
                st.disagg.forget_prefill(key)  # a streamed prefill carries no hand-off fields

        return _SSEResponse(produce, abort_all, on_end)

    collect = asyncio.ensure_future(asyncio.gather(*(_collect(next_piece, i) for i in range(len(keys)))))
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:
            collect.cancel()
            abort_all()
            return Response(status_code=499)
        ends = collect.result()
    finally:
        watcher.cancel()
        st.server_load -= 1
        prefill = st.disagg.forget_prefill(key) if st.disagg is not None else None
    if any(finish == "error" for finish, _ in ends):
        abort_all()
        return error_response(_load_error(st, h), st.cfg.flavor)
    cached = _cached_tokens(stream, h)
    usage = usage_dict(prompt_tokens, sum(o.n_tokens for o in outs), cached, details)
    choices = [Choice(o.text if echoes[j // n] is None else echoes[j // n] + o.text, finish, stop_reason, o.ids if want_ids else None,
                      lps[j].of(o.ids) if lps else None)
               for j, (o, (finish, stop_reason)) in enumerate(zip(outs, ends))]
    build = chat_body if chat else completion_body
    kv_params, choice_extra, top_extra = None, None, None
    held = engine.scheduler.held.get(key)
    if prefill is not None and held is not None and st.disagg is not None:
        extras = st.disagg.prefill_extras(key, prefill, list(engine.kv.req_blocks.get(key, ())), held.num_computed_tokens,
                                          cached, held.output_token_ids[:1])
        kv_params = extras.get("kv_transfer_params")
        if "disaggregated_params" in extras:  # TRT-LLM: in the choice, plus the prompt ids at the top
            choice_extra = {"disaggregated_params": extras["disaggregated_params"]}
            top_extra = {"prompt_token_ids": list(prompt_ids)}
    return Response(build(rid, created, model, choices, None, None, usage, st.fingerprint, kv_params, choice_extra, top_extra,
                          prompt_list), media_type="application/json")


async def _collect(next_piece: Callable[[int], Any], i: int) -> tuple[str | None, Any]:
    while True:
        _delta, _ids, finish, stop_reason = await next_piece(i)
        if finish is not None:
            return finish, stop_reason


async def completions(request: Request) -> Any:
    st: SimState = request.app.state.sim
    st.server_load += 1
    arrival = st.engine.clock()
    body = None
    try:
        body = parse_body(await request.body(), CompletionRequest)
        lora = _lora_of(st, body)
        handoff = _handoff(st, body)
        validate_sampling(body)
        _check_max_tokens(body.max_tokens, "max_tokens", st.cfg.max_model_len)
        prompt = body.prompt
        many = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        prepared = []  # (ids, echo text, max_tokens) of each prompt, in order
        for one in many:
            if one is None or one == "" or one == []:
                raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
            if isinstance(one, str):
                ids = st.tokenizer.encode(one)
                _check_prompt_len(st, len(ids), from_text=True)
            else:
                ids = list(one)
                _check_prompt_len(st, len(ids), from_text=False)
            max_tokens = _effective_max_tokens(st, body.max_tokens if body.max_tokens is not None else 16, len(ids), body.min_tokens)
            prepared.append((ids, (one if isinstance(one, str) else st.tokenizer.decode(ids)) if body.echo else None, max_tokens))
        rid = "cmpl-" + _base_id(request, body.request_id)
        ids, echo, max_tokens = prepared[0]
        return await _generate(st, request, False, rid, body, ids, max_tokens, echo, arrival, handoff, lora, batch=prepared[1:])
    except ApiError as err:
        st.server_load -= 1
        _reject_cleanup(st, body)
        return error_response(err, st.cfg.flavor)


def _lora_of(st: SimState, body: Any) -> tuple[str, str] | None:
    """The adapter a request runs on: its `model` (vLLM), or `lora_path` naming a loaded adapter (SGLang); 404 else."""
    lora = st.check_model(body.model)
    named = (body.model_extra or {}).get("lora_path") if st.cfg.flavor == "sglang" else None
    if lora is None and isinstance(named, str) and named:
        lora = st.loras.get(named)
        if lora is None:
            raise ApiError(f"The LoRA adapter `{named}` is not loaded.", "NotFoundError", 404, "lora_path")
    return lora


def _chat_prompt(st: SimState, body: Any) -> tuple[list[int], tuple]:
    """Chat messages -> (prompt token ids, multimodal items), as workers/multimodal.py lays them out."""
    try:
        messages, items = flatten_messages(body.messages)
    except ContentError as exc:
        raise bad_request(str(exc), exc.param) from exc
    try:
        text = st.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **(body.chat_template_kwargs or {}))
    except Exception as exc:  # template errors are the client's fault
        raise bad_request(f"Failed to apply the chat template: {exc}") from exc
    if not items:
        return st.tokenizer.encode(text, add_special_tokens=False), ()
    ids, mm = tokenize_mm_chat(text, items, lambda piece: st.tokenizer.encode(piece, add_special_tokens=False), st.cfg.mm)
    return ids, tuple(mm)


async def chat_completions(request: Request) -> Any:
    st: SimState = request.app.state.sim
    st.server_load += 1
    arrival = st.engine.clock()
    body = None
    try:
        body = parse_body(await request.body(), ChatCompletionRequest)
        lora = _lora_of(st, body)
        handoff = _handoff(st, body)
        validate_sampling(body)
        requested, param = body.requested_max_tokens()
        _check_max_tokens(requested, param, st.cfg.max_model_len)
        if st.cfg.flavor == "trtllm" and body.prompt_token_ids:  # TRT-LLM generation_only: the ctx prompt ids
            ids = list(body.prompt_token_ids)
            _check_prompt_len(st, len(ids), from_text=False)
            max_tokens = _effective_max_tokens(st, requested, len(ids), body.min_tokens)
            rid = "chatcmpl-" + _base_id(request, body.request_id)
            return await _generate(st, request, True, rid, body, ids, max_tokens, None, arrival, handoff, lora)
        ids, mm_items = _chat_prompt(st, body)
        _check_prompt_len(st, len(ids), from_text=True)
        max_tokens = _effective_max_tokens(st, requested, len(ids), body.min_tokens)
        rid = "chatcmpl-" + _base_id(request, body.request_id)
        return await _generate(st, request, True, rid, body, ids, max_tokens, None, arrival, handoff, lora, mm_items)
    except ApiError as err:
        st.server_load -= 1
        _reject_cleanup(st, body)
        return error_response(err, st.cfg.flavor)
