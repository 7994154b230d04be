"""The dashboard page and the cluster view it polls: GET /dashboard, GET /api/cluster (an admin read).

    GET /api/cluster -> {"policy", "discovery_ok",
                         "workers": [{"worker_id", "model", "backend", "role", "url", "state", "inflight",
                                      "prefill_tokens", "running", "waiting", "kv_usage", "prefix_hit_rate",
                                      "generation_tokens"}, ...],
                         "kv": {"indexed_blocks", "pending_blocks", "events"},
                         "failed_workers": [{"worker_id", "reason", "at", ...}, ...],  (workers whose engine failed)
                         "sessions", "admission", "lora"}  (orchestrator/features_view.py; each worker also has
                                                            "adapters" and "sessions_pinned")
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from orchestrator.features_view import cluster_features
from orchestrator.pool import WorkerPool
from orchestrator.security.guards import AdminGuard
from router import Router
from router.events import KvEventIngestor

__all__ = ["make_cluster_router"]


def make_cluster_router(admin: AdminGuard, pool: WorkerPool, router: Router, ingestor: KvEventIngestor | None,
                        service=None) -> APIRouter:
    api = APIRouter()

    def admin_read(request: Request) -> str:  # 401/403 unless the admin may read
        return admin.check(request.headers, request.client.host if request.client else None, write=False)

    def admin_read_page(request: Request) -> None:
        # A browser cannot send a bearer header when it opens a page, so the page itself (static, no data)
        # is served whenever an admin token exists; its scripts send the token on every read and write.
        if admin.token is None:
            admin_read(request)  # 403 unless a loopback read is allowed

    @api.get("/dashboard", response_class=HTMLResponse, dependencies=[Depends(admin_read_page)])
    async def dashboard() -> Response:
        return HTMLResponse(resources.files("orchestrator").joinpath("static/dashboard.html").read_text())

    @api.get("/api/cluster", dependencies=[Depends(admin_read)])
    async def cluster() -> Response:
        workers = []
        for w in sorted(pool.workers.values(), key=lambda w: w.info.worker_id):
            ld = router.loads.load(w.info.worker_id)
            m = w.metrics
            workers.append({
                "worker_id": w.info.worker_id, "model": w.info.model, "backend": w.info.backend, "role": w.info.role.value,
                "url": w.info.url, "state": w.info.state.value, "inflight": ld.inflight_requests,
                "prefill_tokens": round(ld.prefill_tokens),
                "running": m.num_requests_running if m else None, "waiting": m.num_requests_waiting if m else None,
                "kv_usage": m.kv_cache_usage if m else None,
                "prefix_hit_rate": (m.prefix_cache_hits / m.prefix_cache_queries) if m and m.prefix_cache_queries else None,
                "generation_tokens": m.generation_tokens if m else None,
            })
        index = router.kv_index
        kv = {"indexed_blocks": index.tree_sizes() if index is not None else None,
              "pending_blocks": index.pending_blocks() if index is not None else None,
              "events": ingestor.stats() if ingestor else None}
        # a worker id that registered again after its failure (restarted under the same name) is not failed any more
        failed = [f.model_dump(mode="json") for f in pool.failures
                  if f.worker_id not in pool.workers or pool.workers[f.worker_id].info.started_at < f.at]
        features = cluster_features(router, service) if service is not None else {"per_worker": {}, "cluster": {}}
        for w in workers:  # adapters and sessions per worker; sessions, queue depth per class, adapters for the cluster
            w.update(features["per_worker"].get(w["worker_id"], {"adapters": [], "sessions_pinned": 0}))
        return JSONResponse({"policy": router.policy.name, "discovery_ok": pool.discovery_ok, "workers": workers, "kv": kv,
                             "failed_workers": failed, **features["cluster"]})

    return api
