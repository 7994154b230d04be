"""The access log: one line per inference request (`frontend.log_requests: true`), text or JSON, on the
`kvyard.access` logger.

    {"request_id": "kvy-…", "method": "POST", "path": "/v1/chat/completions", "status": 200, "model": "m",
     "worker": "vllm-1", "prompt_tokens": 812, "cached_tokens": 768, "output_tokens": 64, "queue_s": 0.0,
     "ttft_s": 0.041, "total_s": 0.212, "key_id": "k-…"}

AccessLogMiddleware (pure ASGI) opens a record for each request to an inference path, lets the request fill it in
(`note(...)`: the service knows the model, worker, tokens, queue wait and time to first token; a record is
shared by every task the request starts, through a context variable) and writes the line when the response,
a streamed body included, has gone out. `cached_tokens` are the prompt tokens the router found cached on the chosen
worker (its prediction; the engine's own count is in its usage when it reports one). Times are seconds.
No prompt, no output text, no query string, and the line goes through the same redaction as every log record
(orchestrator/security/redact.py). With the log off the middleware is not installed and `note` returns at once.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from typing import Any

from orchestrator.tracing import inference_route

__all__ = ["AccessLogMiddleware", "note"]

log = logging.getLogger("kvyard.access")
_record: ContextVar[dict | None] = ContextVar("kvyard_access_record", default=None)
_ORDER = ("request_id", "method", "path", "status", "model", "worker", "prompt_tokens", "cached_tokens", "output_tokens",
          "queue_s", "ttft_s", "total_s", "key_id")


def note(**fields: Any) -> None:
    """Add to the current request's access record (nothing when the access log is off or outside a request)."""
    record = _record.get()
    if record is not None:
        record.update(fields)


def format_line(record: dict[str, Any], as_json: bool) -> str:
    fields = {k: record[k] for k in _ORDER if record.get(k) is not None}
    for k in ("queue_s", "ttft_s", "total_s"):
        if k in fields:
            fields[k] = round(fields[k], 6)
    if as_json:
        return json.dumps(fields, separators=(",", ":"))
    return " ".join(f"{k}={v}" for k, v in fields.items())


class AccessLogMiddleware:
    def __init__(self, app, as_json: bool = False) -> None:
        self.app, self.as_json = app, as_json

    async def __call__(self, scope, receive, send) -> None:
        route = inference_route(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        record: dict[str, Any] = {"method": scope["method"], "path": route}
        for k, v in scope.get("headers") or ():
            if k == b"x-request-id":  # the client's id, kept on errors too (the service answers with the same one)
                record["request_id"] = v.decode("latin-1")[:256]
        token = _record.set(record)

        async def logged_send(message) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
                for k, v in message.get("headers") or ():
                    if k == b"x-request-id" and "request_id" not in record:
                        record["request_id"] = v.decode("latin-1")
                    elif k == b"x-kvyard-worker":
                        record.setdefault("worker", v.decode("latin-1"))
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            _record.reset(token)
            record["total_s"] = time.perf_counter() - t0
            record.setdefault("status", 499)  # no response started: the client left
            if record.get("ttft_at") is not None:  # the service's clock: perf_counter when the first token was relayed
                record["ttft_s"] = record["ttft_at"] - t0
            log.info("%s", format_line(record, self.as_json))
