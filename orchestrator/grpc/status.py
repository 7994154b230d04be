"""KvyardError -> gRPC status: the gRPC counterpart of orchestrator.errors.error_response.

    400 INVALID_ARGUMENT   401 UNAUTHENTICATED    403 PERMISSION_DENIED   404 NOT_FOUND
    409 ABORTED            413 RESOURCE_EXHAUSTED (as gRPC itself answers an oversized message)
    429 RESOURCE_EXHAUSTED 499 CANCELLED          501 UNIMPLEMENTED       502/503 UNAVAILABLE
    504 DEADLINE_EXCEEDED  other 4xx INVALID_ARGUMENT, other 5xx INTERNAL

The status details are the OpenAI error message; trailing metadata carries the OpenAI error type and
code (`x-kvyard-error-type`, `x-kvyard-error-code`) and `retry-after` (seconds) where HTTP would send
the Retry-After header.
"""

from __future__ import annotations

import json

import grpc

from orchestrator.errors import KvyardError

__all__ = ["grpc_code", "trailing_metadata", "engine_error"]

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code(status: int) -> grpc.StatusCode:
    if status in _CODES:
        return _CODES[status]
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= status < 500 else grpc.StatusCode.INTERNAL


def trailing_metadata(exc: KvyardError) -> tuple[tuple[str, str], ...]:
    md = [("x-kvyard-error-type", exc.type)]
    if exc.code:
        md.append(("x-kvyard-error-code", str(exc.code)))
    if exc.retry_after is not None:
        md.append(("retry-after", str(max(1, int(round(exc.retry_after))))))
    return tuple(md)


class _EngineRejected(KvyardError):
    type = "invalid_request_error"


def engine_error(status: int, body: bytes) -> KvyardError:
    """An engine's own 4xx answer (OpenAI or vLLM error JSON) as a KvyardError with that status."""
    message = f"the engine refused the request (HTTP {status})"
    try:
        doc = json.loads(body)
        err = doc.get("error", doc) if isinstance(doc, dict) else {}
        if isinstance(err, dict) and err.get("message"):
            message = str(err["message"])
        elif isinstance(err, str) and err:
            message = err
    except (ValueError, UnicodeDecodeError):
        pass
    exc = _EngineRejected(message)
    exc.status = status
    return exc
