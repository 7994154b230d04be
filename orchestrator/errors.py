"""kvyard's exception hierarchy, and the one place that turns errors into OpenAI error JSON.

    KvyardError (500 internal_error)
    ├── BadRequestError          400 invalid_request_error
    │   └── ContextLengthError   400 invalid_request_error / context_length_exceeded
    ├── AuthenticationError      401 authentication_error
    ├── PermissionDeniedError    403 permission_error
    ├── NotFoundError            404 not_found_error / not_found
    │   └── ModelNotFoundError   404 not_found_error / model_not_found
    ├── ConflictError            409 invalid_request_error / version_conflict
    ├── PayloadTooLargeError     413 invalid_request_error / payload_too_large
    ├── RateLimitError           429 rate_limit_error (Retry-After)
    ├── ServiceUnavailableError  503 service_unavailable (Retry-After)
    └── UpstreamError            502 upstream_error (an engine failed and no other could serve)

Third-party errors (httpx, redis, pydantic) are translated where they happen (`raise X from exc`).
Body: {"error": {"message", "type", "param", "code"}} — the shape the OpenAI clients parse.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

__all__ = [
    "KvyardError",
    "BadRequestError",
    "ContextLengthError",
    "AuthenticationError",
    "PermissionDeniedError",
    "ModelNotFoundError",
    "NotFoundError",
    "ConflictError",
    "PayloadTooLargeError",
    "RateLimitError",
    "ServiceUnavailableError",
    "UpstreamError",
    "error_response",
    "error_body",
    "install_error_handlers",
]


class KvyardError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None
    headers: dict[str, str] | None = None  # extra response headers (e.g. x-ratelimit-* on a 429)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after


class BadRequestError(KvyardError):
    status = 400
    type = "invalid_request_error"


class ContextLengthError(BadRequestError):
    code = "context_length_exceeded"


class AuthenticationError(KvyardError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(KvyardError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class NotFoundError(KvyardError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"


class ConflictError(KvyardError):
    status = 409
    type = "invalid_request_error"
    code = "version_conflict"


class PayloadTooLargeError(KvyardError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RateLimitError(KvyardError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ServiceUnavailableError(KvyardError):
    status = 503
    type = "service_unavailable"
    code = "no_capacity"


class UpstreamError(KvyardError):
    status = 502
    type = "upstream_error"
    code = "engine_failed"


def error_body(exc: KvyardError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def error_response(exc: KvyardError) -> Response:
    headers = dict(exc.headers or {})
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(round(exc.retry_after))))
    return Response(json.dumps(error_body(exc)), status_code=exc.status, media_type="application/json", headers=headers)


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, KvyardError], None] | None = None) -> None:
    """Every error the app raises leaves as OpenAI error JSON: ours as they are, FastAPI's validation errors as 400,
    Starlette's HTTP errors (404 for an unknown route, 405, ...) with their status. `on_error` sees ours (metrics)."""

    @app.exception_handler(KvyardError)
    async def _kvyard_error(request: Request, exc: KvyardError) -> Response:
        if on_error is not None:
            on_error(request, exc)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(BadRequestError(str(exc.errors()[:1])))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(ModelNotFoundError(f"no route {request.method} {request.url.path}", code="not_found"))
        err = KvyardError(str(exc.detail))
        err.status, err.type, err.code = exc.status_code, "invalid_request_error", None
        return error_response(err)
