"""HTTP side of the inference guard: authenticate, charge rate limits, hand the request on.

    request, grant = await authorize_inference(guard, request, kind, max_body_bytes, context_len)

When the key has a tokens-per-minute limit the body is read here (bounded by max_body_bytes: 413
past it) to estimate the request's tokens, and the returned request replays that body to whoever
reads it next; otherwise the body is left untouched for the service to stream. The key's public id
is put on `request.state.api_key_id` (the admission queue's per-key hook reads it), and its priority
class and weight on `request.state.api_key_priority` (admission order, resilience/fairshare.py).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from orchestrator.errors import BadRequestError, PayloadTooLargeError, UnsupportedMediaTypeError
from orchestrator.security.guards import InferenceGuard
from orchestrator.security.ratelimit import Grant, estimate_tokens

__all__ = ["authorize_inference", "read_body", "replay", "require_json"]


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON (application/json or application/*+json, any parameters).

    A browser sends text/plain, form and multipart bodies cross-origin without a CORS preflight; requiring
    JSON makes a cross-site page's POST either preflighted (and refused: kvyard sends no CORS headers) or
    refused here, before any work."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json" and not (ctype.startswith("application/") and ctype.endswith("+json")):
        raise UnsupportedMediaTypeError(f"the request body must be JSON (Content-Type: application/json); got "
                                        f"{ctype[:100] or 'no Content-Type'}")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise BadRequestError("client disconnected while sending the body") from exc
    return b"".join(chunks)


def replay(request: Request, body: bytes) -> Request:
    """A Request on the same scope whose body is `body`; later receives (disconnects) pass through."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


async def authorize_inference(guard: InferenceGuard, request: Request, kind: str, max_body_bytes: int,
                              context_len: Callable[[str], int | None]) -> tuple[Request, Grant | None]:
    principal = guard.authenticate(request.headers, "http")
    if principal is None:
        return request, None
    tokens = 0
    if guard.needs_token_estimate(principal):
        raw = await read_body(request, max_body_bytes)
        tokens = estimate_tokens(raw, kind, context_len)
        request = replay(request, raw)
    grant = await guard.admit(principal, tokens)
    request.state.api_key_id = principal.key_id
    request.state.api_key_priority = (principal.priority, principal.weight)
    return request, grant
