"""The frontend ASGI app: builds the parts from the config, wires the route modules, runs the lifespan.

No request logic here (orchestrator/service.py) and no routes (orchestrator/routes/).
"""

from __future__ import annotations

import inspect
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from orchestrator.access_log import AccessLogMiddleware
from orchestrator.config import FrontendConfig
from orchestrator.disagg import DisaggCoordinator
from orchestrator.errors import install_error_handlers
from orchestrator.heap import GcPauses, settle
from orchestrator.hot_path import KvyardApp
from orchestrator.loopwatch import LoopWatch
from orchestrator.metrics import FrontendMetrics
from orchestrator.pool import WorkerPool
from orchestrator.routes import (
    hot_routes,
    make_admin_router,
    make_cluster_router,
    make_dashboard_router,
    make_forwarded_router,
    make_openai_router,
    make_ops_router,
)
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
from orchestrator.routing import build_router
from orchestrator.security.origin import HostOriginGuard, default_allowed_hosts
from orchestrator.passthrough import PassThrough
from orchestrator.service import InferenceService
from orchestrator.telemetry_recorder import FrontendTelemetry, make_telemetry_store
from orchestrator.tracing import Tracing, TracingMiddleware
from router.events import KvEventIngestor
from workers.discovery import Discovery, InMemoryDiscovery, RedisDiscovery
from planner.telemetry.targets import InMemoryTargetsStore, RedisTargetsStore

__all__ = ["create_app", "make_discovery", "make_guards"]

log = logging.getLogger("kvyard.frontend")

# FastAPI's own OpenTelemetry instrumentation (newer releases) looks up the global tracer, meter and logger providers
# on every request, and would add its own span per request beside kvyard's (orchestrator/tracing.py) wherever a
# global provider is set. kvyard's tracing covers the inference routes; FastAPI's is turned off where it exists.
_NO_FASTAPI_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                         if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def make_discovery(cfg: FrontendConfig) -> Discovery:
    if cfg.redis_url:
        return RedisDiscovery(cfg.redis_url, prefix=cfg.discovery_prefix, secret=cfg.security.registry_secret)
    return InMemoryDiscovery()


def make_guards(cfg: FrontendConfig, metrics: FrontendMetrics | None = None) -> tuple[InferenceGuard, AdminGuard]:
    """The inference guard (API keys, rate limits) and the admin guard; logs what is open, loudly."""
    sec = cfg.security
    install_redaction()  # from here on no log record carries a bearer token or key
    register_secret(sec.admin_token)
    keys = KeyStore(sec.api_keys_file) if sec.api_keys_file else None  # a bad file fails the start (KeyFileError)
    if keys is None:
        log.warning("API KEYS ARE OFF: anyone who can reach %s:%d can run inference. Create keys with `kvyard keys create` "
                    "and pass --api-keys-file (or KVYARD_API_KEYS_FILE) to require them.", cfg.host, cfg.port)
    elif not len(keys):
        log.warning("the API key file %s holds no active key: every inference request will be refused", sec.api_keys_file)
    loopback = sec.admin_loopback_reads
    if loopback is None:
        loopback = not sec.admin_token and (cfg.host == "localhost" or is_loopback(cfg.host))
    admin = AdminGuard(sec.admin_token, loopback, metrics)
    (log.info if sec.admin_token else log.warning)("%s", admin.describe())
    if sec.rate_limit_store == "redis" and not cfg.redis_url:
        raise ValueError("rate_limit_store: redis needs redis_url")
    limiter = None  # in-process buckets
    if keys is not None and cfg.redis_url and sec.rate_limit_store != "local":
        limiter = RedisRateLimiter(cfg.redis_url, cfg.discovery_prefix)  # shared by the cluster's frontends
    return InferenceGuard(keys, limiter, metrics=metrics), admin


def create_app(cfg: FrontendConfig, discovery: Discovery | None = None, tracing: Tracing | None = None,
               owns_process: bool = False) -> FastAPI:
    """`tracing`: the request tracer to use instead of cfg.telemetry.tracing's (tests: one with an in-memory exporter).
    `owns_process`: the app is the process's server (`kvyard frontend`, `kvyard up`), not embedded in a test or
    another program: with cfg.gc_freeze it then settles the process's heap (orchestrator/heap.py)."""
    discovery = discovery or make_discovery(cfg)
    metrics = FrontendMetrics()
    router = build_router(cfg)  # orchestrator/routing.py: also what `kvyard replay` routes with
    ingestor = KvEventIngestor(router.kv_index) if router.kv_index is not None else None
    pool = WorkerPool(discovery, router, cfg.refresh_interval_s, cfg.scrape_interval_s, ingestor=ingestor,
                      scrape_timeout_s=cfg.scrape_timeout_s, liveness_failures=cfg.liveness_failures, fast_bpe=cfg.fast_bpe)
    service = InferenceService(cfg, pool, router, metrics)
    service.tracing = tracing or Tracing.from_config(cfg.telemetry.tracing)  # orchestrator/tracing.py; off by default
    # disaggregated prefill/decode for models with prefill or decode workers (orchestrator/disagg)
    service.disagg = DisaggCoordinator(cfg.disagg, pool, router, metrics, service.client, sender=service, kv=cfg.router.kv)
    telemetry_store = make_telemetry_store(cfg.redis_url, cfg.discovery_prefix)
    targets = RedisTargetsStore(cfg.redis_url, cfg.discovery_prefix) if cfg.redis_url else InMemoryTargetsStore()
    if cfg.telemetry.enabled:
        service.telemetry = FrontendTelemetry.for_pool(telemetry_store, pool, cfg.telemetry.interval_s)
    guard, admin = make_guards(cfg, metrics)
    sec = cfg.security
    tls = TlsFiles.load(sec.tls_cert_file, sec.tls_key_file) if sec.tls_cert_file else None  # checked now; uvicorn and gRPC use it
    loopwatch = LoopWatch(metrics.loop_lag, metrics.loop_stalls, cfg.loop_stall_s) if cfg.loop_stall_s else None
    gc_pauses = GcPauses(metrics.gc_pause)  # every collection's pause, on /metrics (orchestrator/heap.py)
    settle_heap = owns_process and cfg.gc_freeze
    if settle_heap:  # each model's tokenizer, once loaded and checked, out of the full collections
        pool.on_tokenizer_ready.append(lambda model: settle(f"the tokenizer of {model} loaded"))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gc_pauses.start()
        await pool.start()
        if service.telemetry is not None:
            service.telemetry.start()
        try:
            if cfg.grpc_port:  # the KServe v2 gRPC endpoint, on this loop, sharing the service and pool
                from orchestrator.grpc import start_grpc_server

                app.state.grpc = await start_grpc_server(service, pool, cfg.grpc_port, cfg.host, guard=guard, tls=tls)
            if settle_heap:  # start-up done: the imports and the app out of the full collections
                settle("start-up")
            if loopwatch is not None:  # from here on: start-up's imports and the tokenizer's check are not stalls
                loopwatch.start()
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
            gc_pauses.stop()
            service.tracing.shutdown()  # the last spans flushed

    app = KvyardApp(title="kvyard", version="0.1.0", lifespan=lifespan, **_NO_FASTAPI_TELEMETRY)
    app.state.cfg, app.state.pool, app.state.router, app.state.metrics = cfg, pool, router, metrics
    app.state.loopwatch = loopwatch
    app.state.service = service  # the request path (tests reach the disagg coordinator's books through it)
    app.state.telemetry_store, app.state.targets = telemetry_store, targets
    app.state.guard, app.state.admin, app.state.tls = guard, admin, tls
    app.state.grpc = None  # orchestrator.grpc.GrpcServer while the lifespan runs with cfg.grpc_port

    def count_error(request: Request, status: int) -> None:
        """Every error answer is counted, by route template (never the raw path: unbounded label values)."""
        route = request.scope.get("route")
        metrics.requests.labels("", getattr(route, "path", None) or "unmatched", str(status)).inc()

    # Host and Origin on state-changing and admin routes (DNS rebinding, cross-site requests; security/origin.py)
    allowed_hosts = frozenset(sec.allowed_hosts) if sec.allowed_hosts is not None else default_allowed_hosts(cfg.host)
    app.add_middleware(HostOriginGuard, allowed_hosts=allowed_hosts, allowed_origins=frozenset(sec.allowed_origins),
                       on_refused=lambda code: metrics.requests.labels("", "host_origin_check", "403").inc())
    if cfg.log_requests:  # one access-log line per inference request (orchestrator/access_log.py)
        app.add_middleware(AccessLogMiddleware, as_json=cfg.log_requests_format == "json")
    if service.tracing.enabled:  # a SERVER span per inference request, its streamed body included
        app.add_middleware(TracingMiddleware, tracing=service.tracing)
    install_error_handlers(app, on_error=count_error)
    openai = make_openai_router(service, guard, pool, cfg.max_body_bytes, cfg.lora)
    app.include_router(openai)
    hot = hot_routes(openai)
    app.router.routes[0:0] = hot  # matched first: the inference POSTs without FastAPI's per-request cost
    app.hot_routes = {r.path: r for r in hot}  # and, where no root_path is set, without the other layers either
    app.include_router(make_forwarded_router(PassThrough(service), guard, pool, cfg.max_body_bytes))
    app.include_router(make_ops_router(pool, metrics))
    app.include_router(make_cluster_router(admin, pool, router, ingestor, service))
    app.include_router(make_dashboard_router(admin))  # GET /api/pools: an admin read
    app.include_router(make_admin_router(targets, admin, telemetry_store, on_error=count_error))
    return app
