"""Read endpoints of the operator dashboard (orchestrator/static/dashboard.html).

    GET /api/pools?window=600&summary=60
        -> {"now", "window_s", "bucket_s", "summary_s",
            "pools": [{"model", "role", "replicas" (live workers of the pool),
                       "summary": {requests, request_rate, tokens_per_s, ttft_p90_ms, itl_p90_ms,
                                   kv_hit_rate, workers} over the last `summary` seconds,
                       "series": [{"t", "replicas", "request_rate", "tokens_per_s", "ttft_p90_ms",
                                   "itl_p90_ms", "kv_hit_rate"}, ...] one point per telemetry bucket,
                       "target": the pool's PoolTarget or null}],
            "targets": {"version", "updated_at", "gpu_budget"} or null,
            "decisions": the planner's newest decisions (reasons included), newest first}

An admin read: `Authorization: Bearer <admin token>`, or a loopback client when the AdminGuard allows
loopback reads (orchestrator/security/guards.py); the admin token never appears in the body. Writes go
through /admin/targets (orchestrator/routes/admin.py).
Rates of the newest, still-filling bucket are divided by the seconds it has covered so far.
"""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from orchestrator.errors import BadRequestError, error_response
from orchestrator.security.guards import AdminGuard
from planner.telemetry.schema import PoolBucket, PoolKey, merge_buckets
from planner.telemetry.store import TelemetryUnavailableError
from planner.telemetry.targets import TargetsUnavailableError

__all__ = ["make_dashboard_router", "bucket_point"]

log = logging.getLogger("kvyard.dashboard")


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name, str(default))
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise BadRequestError(f"{name} must be an integer from {lo} to {hi}", param=name)
    return int(raw)


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def bucket_point(b: PoolBucket, covered_s: float) -> dict:
    """One chart point from one telemetry bucket that covered `covered_s` seconds."""
    s = max(covered_s, 1e-9)
    return {
        "t": b.start,
        "replicas": _r(b.workers_sum / b.gauge_samples, 2) if b.gauge_samples else None,
        "request_rate": _r(b.requests / s),
        "tokens_per_s": _r(b.osl_sum / s, 1),
        "ttft_p90_ms": _r(b.ttft.quantile(0.9), 1),
        "itl_p90_ms": _r(b.itl.quantile(0.9), 2),
        "kv_hit_rate": _r(b.kv_hit_tokens / b.kv_query_tokens, 4) if b.kv_query_tokens else None,
    }


def make_dashboard_router(admin: AdminGuard) -> APIRouter:
    """Reads request.app.state.{telemetry_store, targets, pool}, as create_app sets them."""

    def admin_read(request: Request) -> str:
        return admin.check(request.headers, request.client.host if request.client else None, write=False)

    router = APIRouter(dependencies=[Depends(admin_read)])

    @router.get("/api/pools")
    async def pools(request: Request) -> Response:
        try:
            window = _int_param(request, "window", 600, 10, 6 * 3600)
            summary_s = _int_param(request, "summary", 60, 10, 6 * 3600)
        except BadRequestError as exc:
            return error_response(exc)
        state = request.app.state
        store, targets_store = state.telemetry_store, state.targets
        schema = store.schema
        now = time.time()
        since = schema.bucket_start(now - window)
        notes: list[str] = []
        try:
            buckets = await store.read_pool_buckets(since, now + 1)
            decisions = await store.recent_decisions(20)
        except TelemetryUnavailableError as exc:
            buckets, decisions = {}, []
            notes.append(f"telemetry unavailable: {exc}")
        try:
            vt = await targets_store.get()
        except TargetsUnavailableError as exc:
            vt = None
            notes.append(f"targets unavailable: {exc}")

        live: dict[PoolKey, int] = {}
        for w in state.pool.workers.values():
            key = PoolKey(w.info.model, w.info.role.value)
            live[key] = live.get(key, 0) + (w.info.state.value == "ready")
        keys = set(buckets) | set(live)
        if vt is not None:
            keys |= {PoolKey(p.model, p.role.value) for p in vt.targets.pools}

        summary_since = schema.bucket_start(now - summary_s)
        out = []
        for key in sorted(keys):
            bs = buckets.get(key, [])
            series = [bucket_point(b, min(schema.bucket_s, now - b.start)) for b in bs]
            recent = [b for b in bs if b.start >= summary_since]
            st = merge_buckets(key, recent, window_s=max(now - summary_since, 1.0))
            target = vt.targets.pool(key.model, key.role) if vt is not None else None
            out.append({
                "model": key.model, "role": key.role, "replicas": live.get(key, 0),
                "summary": {"requests": st.requests, "request_rate": _r(st.request_rate), "tokens_per_s": _r(st.tokens_per_s, 1),
                            "ttft_p90_ms": _r(st.ttft_p90_ms, 1), "itl_p90_ms": _r(st.itl_p90_ms, 2),
                            "kv_hit_rate": _r(st.kv_hit_rate, 4), "workers": _r(st.workers, 2), "errors": st.errors},
                "series": series,
                "target": target.model_dump(mode="json") if target is not None else None,
            })
        body = {
            "now": now, "window_s": window, "bucket_s": schema.bucket_s, "summary_s": summary_s, "pools": out,
            "targets": {"version": vt.version, "updated_at": vt.updated_at, "gpu_budget": vt.targets.gpu_budget} if vt else None,
            "decisions": decisions, "notes": notes,
        }
        return JSONResponse(body)

    return router
