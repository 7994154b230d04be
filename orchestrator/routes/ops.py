"""Operations endpoints: an index at /, liveness, readiness and Prometheus metrics. None needs a key."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from orchestrator.metrics import FrontendMetrics
from orchestrator.pool import WorkerPool

__all__ = ["make_ops_router", "INDEX"]

# GET / answers with where things are (a browser or `curl` on the bare address lands somewhere useful)
INDEX = {
    "service": "kvyard",
    "openai": {"models": "/v1/models", "chat": "/v1/chat/completions", "completions": "/v1/completions",
               "embeddings": "/v1/embeddings", "responses": "/v1/responses"},
    "tokens": {"tokenize": "/tokenize", "detokenize": "/detokenize"},
    "dashboard": "/dashboard",
    "health": {"live": "/live", "ready": "/health"},
    "metrics": "/metrics",
    "admin": {"targets": "/admin/targets", "cluster": "/api/cluster", "pools": "/api/pools"},
    "openapi": "/openapi.json",
}


def make_ops_router(pool: WorkerPool, metrics: FrontendMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/")
    async def index() -> Response:
        return JSONResponse(INDEX)

    @router.get("/live")
    async def live() -> Response:
        return JSONResponse({"status": "ok"})

    @router.get("/health")
    async def health() -> Response:
        ready = sum(1 for w in pool.workers.values() if w.info.state.value == "ready")
        body = {"status": "ok" if ready else "no_workers", "workers": len(pool.workers), "ready": ready,
                "discovery": "ok" if pool.discovery_ok else "unreachable"}
        return JSONResponse(body, status_code=200 if ready else 503)

    @router.get("/metrics")
    async def prom() -> Response:
        metrics.workers.clear()  # re-derived from the live view on each scrape
        for w in pool.workers.values():
            metrics.workers.labels(w.info.model, w.info.state.value).inc()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router
