"""Admin API for planner targets: a FastAPI APIRouter the frontend app mounts.

    GET  /admin/targets            -> {"version", "updated_at", "updated_by", "targets"} (404 if never set)
    PUT  /admin/targets            body: Targets JSON; optional header If-Match: <version> (or "0" to
                                   create) -> the new VersionedTargets; 400 names the bad field,
                                   409 on a version mismatch
    GET  /admin/targets/history    ?limit=20 -> {"data": [VersionedTargets, ...]} newest first
    GET  /admin/planner/decisions  ?limit=50 -> {"data": [decision records]} newest first (if a
                                   telemetry store is given)
Every route needs `Authorization: Bearer <admin token>` (compared in constant time; 401 otherwise).
With no token configured the admin API is disabled: writes are refused 403 `admin_disabled`, and so
are reads unless the AdminGuard allows loopback reads (orchestrator/security/guards.py). Errors are
OpenAI-style JSON via orchestrator.errors.error_response.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from orchestrator.errors import (
    BadRequestError,
    ConflictError,
    KvyardError,
    NotFoundError,
    ServiceUnavailableError,
    error_response,
)
from orchestrator.json_input import load_json
from orchestrator.security.guards import AdminGuard
from planner.telemetry.store import TelemetryStore, TelemetryUnavailableError
from planner.telemetry.targets import (
    TargetsConflictError,
    TargetsStore,
    TargetsUnavailableError,
    TargetsValidationError,
    parse_targets,
)

__all__ = ["make_admin_router"]

log = logging.getLogger("kvyard.admin")


def _limit(request: Request, default: int) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise BadRequestError("limit must be an integer from 1 to 1000", param="limit")
    return int(raw)


def make_admin_router(targets: TargetsStore, admin: AdminGuard | str | None, telemetry: TelemetryStore | None = None,
                      prefix: str = "/admin", on_error: Callable[[Request, int], None] | None = None) -> APIRouter:
    """`admin`: the app's AdminGuard, or a token (None: disabled) for a router used on its own.
    `on_error(request, status)`: told of every error answer (the app counts them in its request metrics)."""
    router = APIRouter(prefix=prefix)
    guard = admin if isinstance(admin, AdminGuard) else AdminGuard(admin)

    async def guarded(request: Request, fn) -> Response:
        try:
            actor = guard.check(request.headers, request.client.host if request.client else None, write=request.method != "GET")
            return await fn(actor)
        except KvyardError as exc:
            return failed(request, exc)
        except (TargetsUnavailableError, TelemetryUnavailableError) as exc:
            return failed(request, ServiceUnavailableError(f"the state store is unreachable: {exc}", code="store_unavailable", retry_after=1))

    def failed(request: Request, exc: KvyardError) -> Response:
        if on_error is not None:
            on_error(request, exc.status)
        return error_response(exc)

    @router.get("/targets")
    async def get_targets(request: Request) -> Response:
        async def run(_actor: str) -> Response:
            vt = await targets.get()
            if vt is None:
                raise NotFoundError("no targets have been set yet")
            return JSONResponse(vt.model_dump(mode="json"))
        return await guarded(request, run)

    @router.put("/targets")
    async def put_targets(request: Request) -> Response:
        async def run(actor: str) -> Response:
            data = load_json(await request.body() or b"null", "body")
            try:
                new = parse_targets(data)
            except TargetsValidationError as exc:
                raise BadRequestError(str(exc), param=exc.field, code="invalid_targets") from exc
            expected = request.headers.get("if-match")
            if expected is not None and not expected.strip('"').isdigit():
                raise BadRequestError("If-Match must be a targets version number", param="If-Match")
            try:
                vt = await targets.put(new, expected_version=int(expected.strip('"')) if expected else None, actor=actor)
            except TargetsConflictError as exc:
                raise ConflictError(str(exc)) from exc
            log.info("targets set to version %d", vt.version)
            return JSONResponse(vt.model_dump(mode="json"))
        return await guarded(request, run)

    @router.get("/targets/history")
    async def targets_history(request: Request) -> Response:
        async def run(_actor: str) -> Response:
            items = await targets.history(_limit(request, 20))
            return JSONResponse({"data": [v.model_dump(mode="json") for v in items]})
        return await guarded(request, run)

    @router.get("/planner/decisions")
    async def decisions(request: Request) -> Response:
        async def run(_actor: str) -> Response:
            if telemetry is None:
                raise NotFoundError("no telemetry store is configured")
            return JSONResponse({"data": await telemetry.recent_decisions(_limit(request, 50))})
        return await guarded(request, run)

    return router
