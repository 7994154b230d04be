"""A scriptable, vLLM-shaped engine for the reliability tests: streams that break, hang or end early.

Each output token is one word from WORDS (each a single cl100k token, so re-tokenizing the text
gives back the ids: the sim's property). Chunks follow vLLM 0.32's layout (compact JSON,
`token_ids` per chunk when `return_token_ids` is asked; ids are TOKEN_BASE + k then, deliberately
not the words' real ids, so a test can tell engine ids from re-tokenized ones).

Faults (set on the instance, may change between requests):
    break_after  k: the connection is dropped after k content chunks
    stop_after   k: the stream ends cleanly after k chunks, without finish_reason or [DONE]
    stall_after  k: after k chunks the engine goes silent (the socket stays open)
    break_before_done  everything, the usage chunk included, then the connection drops before [DONE]
    hang         accept the request and never answer headers
    fail_status  answer with this HTTP status
    health       status of GET /health
A shared `plan` (a list of such dicts, consumed one per request, by whichever engine gets it) makes
"the first request breaks, wherever the router sends it" easy to script.
"""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.testing.fake_engine import ThreadedEngine

__all__ = ["FaultEngine", "WORDS", "TOKEN_BASE"]

WORDS = [" the", " cat", " sat", " on", " mat", " and", " dog", " ran", " far", " away", " from", " home"]
TOKEN_BASE = 50000


def _dumps(o) -> str:
    return json.dumps(o, separators=(",", ":"))


class FaultEngine(ThreadedEngine):
    def __init__(self, name: str = "e", prompt_tokens: int = 3, plan: list[dict] | None = None) -> None:
        self.name = name
        self.plan = plan if plan is not None else []
        self.prompt_tokens = prompt_tokens
        self.break_after: int | None = None
        self.stop_after: int | None = None
        self.stall_after: int | None = None
        self.hang = False
        self.fail_status: int | None = None
        self.health = 200
        self.requests: list[dict] = []  # {"path", "body"}
        self.health_checks = 0
        self._serve_routes([
            Route("/v1/completions", self._complete, methods=["POST"]),
            Route("/v1/chat/completions", self._complete, methods=["POST"]),
            Route("/health", self._health),
            Route("/metrics", lambda r: PlainTextResponse("")),
        ])

    async def _health(self, request: Request) -> Response:
        self.health_checks += 1
        return PlainTextResponse("", status_code=self.health)

    async def _complete(self, request: Request):
        body = await request.json()
        self.requests.append({"path": request.url.path, "body": body})
        fault = self.plan.pop(0) if self.plan else {}
        if fault.get("hang", self.hang):
            await asyncio.sleep(3600)
        if self.fail_status:
            return JSONResponse({"error": {"message": "boom", "type": "InternalError", "code": self.fail_status}}, status_code=self.fail_status)
        chat = request.url.path.endswith("chat/completions")
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 8
        p = body.get("prompt")
        prompt_tokens = len(p) if isinstance(p, list) else self.prompt_tokens
        rid, created, model = f"cmpl-{self.name}-{len(self.requests)}", 1700000000 + len(self.requests), body["model"]
        want_ids = bool(body.get("return_token_ids"))
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": model}
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}
        if not body.get("stream"):
            text = "".join(WORDS[k % len(WORDS)] for k in range(n))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                                 "usage": usage, "finish_reason": "length"})
        break_after = fault.get("break_after", self.break_after)
        stop_after = fault.get("stop_after", self.stop_after)
        stall_after = fault.get("stall_after", self.stall_after)

        async def gen():
            if chat:
                yield "data: " + _dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                              "logprobs": None, "finish_reason": None}]}) + "\n\n"
            for k in range(n):
                if break_after is not None and k == break_after:
                    # a real engine dies between steps, after its last event went out: without the pause the event
                    # and the broken chunked ending can reach the frontend in one read, which then sees no event
                    await asyncio.sleep(0.05)
                    raise RuntimeError("engine died mid-stream")
                if stop_after is not None and k == stop_after:
                    return
                if stall_after is not None and k == stall_after:
                    await asyncio.sleep(3600)
                word = WORDS[k % len(WORDS)]
                fin = "length" if k == n - 1 else None
                choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                choice.update({"logprobs": None, "finish_reason": fin})
                if not chat:
                    choice["stop_reason"] = None
                choice["token_ids"] = [TOKEN_BASE + k] if want_ids else None
                if not chat:
                    choice["prompt_token_ids"] = (list(p) if isinstance(p, list) else [1, 2, 3]) if (want_ids and k == 0) else None
                yield "data: " + _dumps({**head, "choices": [choice]}) + "\n\n"
                await asyncio.sleep(0.002)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + _dumps({**head, "choices": [], "usage": usage}) + "\n\n"
            if fault.get("break_before_done"):
                raise RuntimeError("engine died before [DONE]")
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream; charset=utf-8")
