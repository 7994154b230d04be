"""The frontend ASGI app: routes, error mapping, lifespan. No request logic here (see service.py)."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response

from orchestrator.config import FrontendConfig
from orchestrator.errors import BadRequestError, KvyardError, ModelNotFoundError, error_response
from orchestrator.loopwatch import LoopWatch
from orchestrator.metrics import FrontendMetrics
from orchestrator.admin import make_admin_router
from orchestrator.dashboard import make_dashboard_router
from orchestrator.pool import WorkerPool
from orchestrator.security import (
    AdminGuard,
    InferenceGuard,
    KeyStore,
    RedisRateLimiter,
    TlsFiles,
    install_redaction,
    is_loopback,
    register_secret,
)
from orchestrator.security.http import authorize_inference
from orchestrator.telemetry_recorder import FrontendTelemetry, make_telemetry_store
from workers.telemetry.targets import InMemoryTargetsStore, RedisTargetsStore
from orchestrator.disagg import DisaggCoordinator
from orchestrator.service import InferenceService
from orchestrator.routing import build_router
from router.events import KvEventIngestor
from workers.discovery import Discovery, InMemoryDiscovery, RedisDiscovery

__all__ = ["create_app", "make_discovery", "make_guards"]

log = logging.getLogger("kvyard.frontend")


def make_discovery(cfg: FrontendConfig) -> Discovery:
    if cfg.redis_url:
        return RedisDiscovery(cfg.redis_url, prefix=cfg.discovery_prefix)
    return InMemoryDiscovery()


def make_guards(cfg: FrontendConfig, metrics: FrontendMetrics | None = None) -> tuple[InferenceGuard, AdminGuard]:
    """The inference guard (API keys, rate limits) and the admin guard; logs what is open, loudly."""
    install_redaction()  # from here on no log record carries a bearer token or key
    register_secret(cfg.admin_token)
    keys = KeyStore(cfg.api_keys_file) if cfg.api_keys_file else None  # a bad file fails the start (KeyFileError)
    if keys is None:
        log.warning("API KEYS ARE OFF: anyone who can reach %s:%d can run inference. Create keys with `kvyard keys create` "
                    "and pass --api-keys-file (or KVYARD_API_KEYS_FILE) to require them.", cfg.host, cfg.port)
    elif not len(keys):
        log.warning("the API key file %s holds no active key: every inference request will be refused", cfg.api_keys_file)
    loopback = cfg.admin_loopback_reads
    if loopback is None:
        loopback = not cfg.admin_token and (cfg.host == "localhost" or is_loopback(cfg.host))
    admin = AdminGuard(cfg.admin_token, loopback, metrics)
    (log.info if cfg.admin_token else log.warning)("%s", admin.describe())
    if cfg.rate_limit_store == "redis" and not cfg.redis_url:
        raise ValueError("rate_limit_store: redis needs redis_url")
    limiter = None  # in-process buckets
    if keys is not None and cfg.redis_url and cfg.rate_limit_store != "local":
        limiter = RedisRateLimiter(cfg.redis_url, cfg.discovery_prefix)  # shared by the cluster's frontends
    return InferenceGuard(keys, limiter, metrics=metrics), admin


def create_app(cfg: FrontendConfig, discovery: Discovery | None = None) -> FastAPI:
    discovery = discovery or make_discovery(cfg)
    metrics = FrontendMetrics()
    router = build_router(cfg)  # orchestrator/routing.py: also what `kvyard replay` routes with
    ingestor = KvEventIngestor(router.kv_index) if router.kv_index is not None else None
    pool = WorkerPool(discovery, router, cfg.refresh_interval_s, cfg.scrape_interval_s, ingestor=ingestor)
    service = InferenceService(cfg, pool, router, metrics)
    # disaggregated prefill/decode for models with prefill or decode workers (orchestrator/disagg)
    prefill_reuse = cfg.kv_reuse_weight if cfg.disagg.prefill_reuse_weight is None else cfg.disagg.prefill_reuse_weight
    service.disagg = DisaggCoordinator(cfg.disagg, pool, router, metrics, service.client, cfg.kv_overlap_weight, prefill_reuse)
    telemetry_store = make_telemetry_store(cfg.redis_url, cfg.discovery_prefix)
    targets = RedisTargetsStore(cfg.redis_url, cfg.discovery_prefix) if cfg.redis_url else InMemoryTargetsStore()
    if cfg.telemetry:
        service.telemetry = FrontendTelemetry.for_pool(telemetry_store, pool, cfg.telemetry_interval_s)
    guard, admin = make_guards(cfg, metrics)
    tls = TlsFiles.load(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file else None  # checked now, used by uvicorn and gRPC

    loopwatch = LoopWatch(metrics.loop_lag, metrics.loop_stalls, cfg.loop_stall_s) if cfg.loop_stall_s else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if loopwatch is not None:
            loopwatch.start()
        await pool.start()
        if service.telemetry is not None:
            service.telemetry.start()
        try:
            if cfg.grpc_port:  # the KServe v2 gRPC endpoint, on this loop, sharing the service and pool
                from orchestrator.grpc import start_grpc_server

                app.state.grpc = await start_grpc_server(service, pool, cfg.grpc_port, cfg.host, guard=guard, tls=tls)
            yield
        finally:
            if app.state.grpc is not None:
                await app.state.grpc.stop()
                app.state.grpc = None
            if service.telemetry is not None:
                await service.telemetry.close()  # a last flush
            await pool.close()
            await service.close()
            for store in (telemetry_store, targets, guard):
                await store.close()
            if loopwatch is not None:
                await loopwatch.close()

    app = FastAPI(title="kvyard", version="0.1.0", lifespan=lifespan)
    app.state.cfg, app.state.pool, app.state.router, app.state.metrics = cfg, pool, router, metrics
    app.state.loopwatch = loopwatch
    app.state.service = service  # the request path (tests reach the disagg coordinator's books through it)
    app.state.telemetry_store, app.state.targets = telemetry_store, targets
    app.state.guard, app.state.admin, app.state.tls = guard, admin, tls
    app.include_router(make_admin_router(targets, admin, telemetry_store))
    app.include_router(make_dashboard_router(admin))  # GET /api/pools: an admin read

    def admin_read(request: Request) -> str:  # a FastAPI dependency: 401/403 unless the admin may read
        return admin.check(request.headers, request.client.host if request.client else None, write=False)

    def admin_read_page(request: Request) -> None:
        # A browser cannot send a bearer header when it opens a page, so the page itself (static, no data)
        # is served whenever an admin token exists; its scripts send the token on every read and write.
        if admin.token is None:
            admin_read(request)  # 403 unless a loopback read is allowed

    def model_context(model: str) -> int | None:
        info = pool.info_for(model)
        return info.max_model_len if info else None

    async def inference(request: Request, kind: str) -> Response:
        request, grant = await authorize_inference(guard, request, kind, cfg.max_body_bytes, model_context)
        response = await service.handle(request, kind)
        if grant is not None:
            response.headers.update(grant.headers())
        return response

    app.state.grpc = None  # orchestrator.grpc.GrpcServer while the lifespan runs with cfg.grpc_port

    @app.exception_handler(KvyardError)
    async def _kvyard_error(request: Request, exc: KvyardError) -> Response:
        metrics.requests.labels("", request.url.path, str(exc.status)).inc()
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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await inference(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await inference(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        guard.authenticate(request.headers, "http")
        data = []
        for name in pool.models():
            info = pool.info_for(name)
            data.append({"id": name, "object": "model", "created": int(info.started_at if info else time.time()),
                         "owned_by": "kvyard", "root": name, "parent": None,
                         "max_model_len": info.max_model_len if info else None})
        return JSONResponse({"object": "list", "data": data})

    @app.get("/live")
    async def live() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
        ready = sum(1 for w in pool.workers.values() if w.info.state.value == "ready")
        body = {"status": "ok" if ready else "no_workers", "workers": len(pool.workers), "ready": ready,
                "discovery": "ok" if pool.discovery_ok else "unreachable"}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        metrics.workers.clear()  # re-derived from the live view on each scrape
        for w in pool.workers.values():
            metrics.workers.labels(w.info.model, w.info.state.value).inc()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard", response_class=HTMLResponse, dependencies=[Depends(admin_read_page)])
    async def dashboard() -> Response:
        return HTMLResponse(resources.files("orchestrator").joinpath("static/dashboard.html").read_text())

    @app.get("/api/cluster", dependencies=[Depends(admin_read)])
    async def cluster() -> Response:
        workers = []
        for w in sorted(pool.workers.values(), key=lambda w: w.info.worker_id):
            ld = router.loads.load(w.info.worker_id)
            m = w.metrics
            workers.append({
                "worker_id": w.info.worker_id, "model": w.info.model, "backend": w.info.backend, "role": w.info.role.value,
                "url": w.info.url, "state": w.info.state.value, "inflight": ld.inflight_requests, "prefill_tokens": round(ld.prefill_tokens),
                "running": m.num_requests_running if m else None, "waiting": m.num_requests_waiting if m else None,
                "kv_usage": m.kv_cache_usage if m else None,
                "prefix_hit_rate": (m.prefix_cache_hits / m.prefix_cache_queries) if m and m.prefix_cache_queries else None,
                "generation_tokens": m.generation_tokens if m else None,
            })
        kv = {"indexed_blocks": router.kv_index.tree_sizes() if router.kv_index is not None else None,
              "pending_blocks": router.kv_index.pending_blocks() if router.kv_index is not None else None,
              "events": ingestor.stats() if ingestor else None}
        return JSONResponse({"policy": router.policy.name, "discovery_ok": pool.discovery_ok, "workers": workers, "kv": kv})

    return app
