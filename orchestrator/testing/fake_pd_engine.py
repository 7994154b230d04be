"""In-process fake engines speaking the three P/D hand-off protocols, for the disagg coordinator tests.

Not a simulator (workers/sim is): each fake checks the hand-off fields the real engine checks
(workers/{vllm,sglang,trtllm}/handoff.py), records every request it got, and scripts failures (an HTTP status
for every request or the first few, a slow prefill, a malformed answer). Prefill and decode fakes
of one test share a `HandoffBook`, standing in for the engines' side channel (NIXL / bootstrap server / cache transceiver):

    vllm    prefill holds blocks under (engine_id, request id) until decode reads them, or decode
            aborts and notifies prefill (vLLM's abort-notify path): both free them in `held`
    sglang  prefill publishes its bootstrap room; decode waits for that room before generating
    trtllm  a context_only request leaves a ctx_request_id that a generation_only request must name
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from orchestrator.testing.fake_engine import ThreadedEngine

__all__ = ["HandoffBook", "FakePDEngine"]

_VLLM_DECODE_REQUIRED = ("do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size",
                         "remote_block_ids")


@dataclass
class HandoffBook:
    held: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # vllm: blocks held by prefill
    freed: list[tuple[str, str, str]] = field(default_factory=list)  # vllm: (engine, request, "read"|"abort")
    rooms: set[int] = field(default_factory=set)  # sglang: rooms whose prefill finished
    contexts: set[int] = field(default_factory=set)  # trtllm: ctx_request_ids awaiting generation


def _err(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "BadRequestError", "param": None, "code": status}}, status_code=status)


class FakePDEngine(ThreadedEngine):
    def __init__(self, flavor: str, role: str, book: HandoffBook, tokens: int = 4, fail_status: int | None = None,
                 delay_s: float = 0.0, omit_handoff: bool = False, ctx_finish_reason: str = "length",
                 token_delay_s: float = 0.005, fail_times: int | None = None) -> None:
        self.flavor, self.role, self.book = flavor, role, book
        self.tokens, self.fail_status, self.delay_s = tokens, fail_status, delay_s
        self.fail_times = fail_times  # fail only the first this many requests (None: all)
        self.omit_handoff, self.ctx_finish_reason, self.token_delay_s = omit_handoff, ctx_finish_reason, token_delay_s
        self.requests: list[dict] = []
        self.cancelled = 0  # requests the client dropped while this engine was working on them
        self.completed = 0
        self._ctx_ids = 0
        self._serve_routes([
            Route("/v1/completions", self._serve, methods=["POST"]),
            Route("/v1/chat/completions", self._serve, methods=["POST"]),
            Route("/health", lambda r: PlainTextResponse("")),
            Route("/metrics", lambda r: PlainTextResponse("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n")),
        ])
        self.engine_id = f"engine-{self.port}"

    @property
    def bodies(self) -> list[dict]:
        return [r["body"] for r in self.requests]

    # ---- helpers -------------------------------------------------------------------------------

    async def _wait(self, request: Request, seconds: float, until=None) -> bool:
        """Sleep up to `seconds` (or until `until()` holds); False when the client went away meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if until is not None and until():
                return True
            if await request.is_disconnected():
                self.cancelled += 1
                return False
            await asyncio.sleep(0.005)
        return until is None or until()

    def _answer(self, body: dict, chat: bool, n: int, finish: str, extra_choice: dict | None = None, extra: dict | None = None) -> dict:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None, **(extra_choice or {})}
        if chat:
            choice["message"] = {"role": "assistant", "content": "x" * n}
        else:
            choice["text"] = "x" * n
        return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "created": 1, "model": body["model"],
                "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}, **(extra or {})}

    def _generate(self, request: Request, body: dict, chat: bool, on_done, on_abort, wait_for=None):
        """The decode side's answer: SSE or JSON; `wait_for` (sglang) gates generation on the hand-off."""
        n = min(self.tokens, body.get("max_tokens") or self.tokens)
        if not body.get("stream"):
            async def unary():
                if wait_for is not None and not await self._wait(request, 5.0, wait_for):
                    on_abort()
                    return _err(503, "hand-off never arrived")
                if not await self._wait(request, self.token_delay_s * n):
                    on_abort()
                    return _err(499, "client gone")
                on_done()
                self.completed += 1
                return JSONResponse(self._answer(body, chat, n, "length"))
            return unary()

        async def gen():
            try:
                if wait_for is not None:
                    for _ in range(1000):
                        if wait_for():
                            break
                        await asyncio.sleep(0.005)
                    else:
                        yield "data: " + json.dumps({"error": {"message": "hand-off never arrived"}}) + "\n\n"
                        return
                for _ in range(n):
                    delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
                    yield "data: " + json.dumps({"id": "cmpl-fake", "choices": [{"index": 0, **delta, "finish_reason": None}]},
                                                separators=(",", ":")) + "\n\n"
                    await asyncio.sleep(self.token_delay_s)
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
                    yield "data: " + json.dumps({"id": "cmpl-fake", "choices": [], "usage": usage}, separators=(",", ":")) + "\n\n"
                yield "data: [DONE]\n\n"
                on_done()
                self.completed += 1
            except asyncio.CancelledError:
                self.cancelled += 1
                on_abort()
                raise

        async def stream():
            return StreamingResponse(gen(), media_type="text/event-stream; charset=utf-8")
        return stream()

    # ---- the engine ----------------------------------------------------------------------------

    async def _serve(self, request: Request):
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers)})
        chat = request.url.path.endswith("chat/completions")
        if self.fail_status and (self.fail_times is None or len(self.requests) <= self.fail_times):
            # after delay_s: a prefill that fails while its decode is already waiting
            if not await self._wait(request, self.delay_s):
                return _err(499, "client gone")
            return _err(self.fail_status, "scripted failure")
        handler = {"vllm": self._vllm, "sglang": self._sglang, "trtllm": self._trtllm}[self.flavor]
        return await handler(request, body, chat)

    async def _vllm(self, request: Request, body: dict, chat: bool):
        params = body.get("kv_transfer_params")
        rid = request.headers.get("x-request-id", "")
        if self.role == "prefill":
            if not (params or {}).get("do_remote_decode") or body.get("stream") or body.get("max_tokens") != 1:
                return _err(400, "not a prefill request")
            if not await self._wait(request, self.delay_s):
                return _err(499, "client gone")
            self.book.held[(self.engine_id, rid)] = [1, 2, 3]
            self.completed += 1
            out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3], "remote_engine_id": self.engine_id,
                   "remote_request_id": rid, "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
                   "remote_blocks_expiry_time": time.time() + 480}
            return JSONResponse(self._answer(body, chat, 1, "length", extra=None if self.omit_handoff else {"kv_transfer_params": out}))
        if params is not None:  # decode of a hand-off: the fields must be there and name held blocks
            missing = [f for f in _VLLM_DECODE_REQUIRED if f not in params]
            key = (params.get("remote_engine_id"), params.get("remote_request_id"))
            if missing or key not in self.book.held:
                return _err(400, f"bad or stale kv_transfer_params (missing {missing})")

            def release(how: str):
                if self.book.held.pop(key, None) is not None:
                    self.book.freed.append((key[0], key[1], how))
            return await self._generate(request, body, chat, lambda: release("read"), lambda: release("abort"))
        return await self._generate(request, body, chat, lambda: None, lambda: None)

    async def _sglang(self, request: Request, body: dict, chat: bool):
        room = body.get("bootstrap_room")
        has = all(k in body for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
        if self.role == "prefill":
            if not has:
                return _err(400, "prefill needs bootstrap fields")
            if not await self._wait(request, self.delay_s):
                return _err(499, "client gone")
            self.book.rooms.add(room)
            self.completed += 1
            if body.get("stream"):  # the prefill server streams too when the shared body asks for it
                first = json.dumps({"id": "cmpl-fake", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})
                return StreamingResponse(iter([f"data: {first}\n\n", "data: [DONE]\n\n"]), media_type="text/event-stream")
            return JSONResponse(self._answer(body, chat, 1, "length"))
        if self.role == "decode":
            if not has:
                return _err(400, "decode needs bootstrap fields")
            return await self._generate(request, body, chat, lambda: None, lambda: None, wait_for=lambda: room in self.book.rooms)
        return await self._generate(request, body, chat, lambda: None, lambda: None)

    async def _trtllm(self, request: Request, body: dict, chat: bool):
        params = body.get("disaggregated_params") or {}
        kind = params.get("request_type")
        if kind == "context_only":
            if body.get("stream") or "disagg_request_id" not in params:
                return _err(400, "bad context request")
            if not await self._wait(request, self.delay_s):
                return _err(499, "client gone")
            self._ctx_ids += 1
            ctx_id = self.port * 1000 + self._ctx_ids
            self.book.contexts.add(ctx_id)
            self.completed += 1
            dp = {"request_type": "context_only", "first_gen_tokens": [7], "ctx_request_id": ctx_id, "encoded_opaque_state": "b3BhcXVl",
                  "draft_tokens": None, "disagg_request_id": params["disagg_request_id"]}
            extra_choice = {} if self.omit_handoff else {"disaggregated_params": dp}
            return JSONResponse(self._answer(body, chat, 1, self.ctx_finish_reason, extra_choice, {"prompt_token_ids": [11, 12, 13]}))
        if kind == "generation_only":
            ids = body.get("prompt_token_ids") if chat else body.get("prompt")
            ctx_id = params.get("ctx_request_id")
            if ctx_id not in self.book.contexts or not isinstance(ids, list) or "encoded_opaque_state" not in params:
                return _err(400, "bad or stale disaggregated_params")
            return await self._generate(request, body, chat, lambda: self.book.contexts.discard(ctx_id), lambda: self.book.contexts.discard(ctx_id))
        return await self._generate(request, body, chat, lambda: None, lambda: None)
