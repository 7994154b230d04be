"""What `kvyard up`, `kvyard worker` and `kvyard frontend` run, given their typed config (built in orchestrator/cli.py)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import signal
import tempfile
from pathlib import Path

import uvicorn

from orchestrator.config import ClusterConfig, FrontendConfig, WorkerConfig

__all__ = ["run_up", "run_worker", "run_frontend", "worker_setup"]

log = logging.getLogger("kvyard")


def _say(text: str) -> None:
    """Print for the operator: secrets (a Redis password, tokens, keys) masked as in the logs."""
    from orchestrator.security import redact

    print(redact(text), flush=True)


async def _serve(app, cfg: FrontendConfig) -> uvicorn.Server:
    from orchestrator.security.connections import guarded_protocol

    tls = app.state.tls.uvicorn_kwargs() if getattr(app.state, "tls", None) else {}  # checked by create_app
    closed = app.state.metrics.connections_closed
    # slow and idle clients: header/body read deadlines and a connection bound (orchestrator/security/connections.py)
    http = guarded_protocol(cfg.header_timeout_s, cfg.body_timeout_s, cfg.max_connections,
                            on_closed=lambda reason: closed.labels(reason).inc())
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                                           timeout_keep_alive=30, backlog=4096, http=http, **tls))
    server.install_signal_handlers = lambda: None  # we own SIGINT/SIGTERM
    return server


def _with_local_admin_token(fcfg: FrontendConfig) -> tuple[FrontendConfig, bool]:
    """Local use without a configured admin token: a one-off token for the dashboard and /api/* (printed once, as
    Jupyter does). Like any admin token it is required from every client, this machine's included; set
    KVYARD_ADMIN_TOKEN to choose it (local scripts reading /api/cluster then send it as a bearer token)."""
    sec = fcfg.security
    if sec.admin_token:
        return fcfg, False
    sec = sec.model_copy(update={"admin_token": secrets.token_urlsafe(24)})
    return fcfg.model_copy(update={"security": sec}), True


async def run_up(ccfg: ClusterConfig) -> int:
    from orchestrator.app import create_app, make_discovery
    from orchestrator.launcher import LocalCluster

    fcfg, token_generated = _with_local_admin_token(ccfg.frontend)
    if ccfg.ray.enabled:
        from orchestrator.ray_cluster import RayCluster, RayOptions

        r = ccfg.ray
        cluster = RayCluster(ccfg, RayOptions(address=r.address, num_cpus=r.num_cpus, actor_cpus=r.actor_cpus,
                                              gpus_per_worker=r.gpus_per_worker, max_workers=max(ccfg.workers, 4),
                                              engine_host=r.engine_host, start_timeout_s=ccfg.engine_start_timeout_s),
                             redis_url=fcfg.redis_url, prefix=fcfg.discovery_prefix)
        log.info("starting %d %s workers as Ray actors…", ccfg.workers, ccfg.backend)
        await cluster.start()
        discovery = cluster.discovery
    else:
        discovery = make_discovery(fcfg)
        cluster = LocalCluster(ccfg, discovery)
        log.info("starting %d %s workers…", ccfg.workers, ccfg.backend)
        await cluster.start()
    app = create_app(fcfg, discovery, owns_process=True)
    server = await _serve(app, fcfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    serve_task = asyncio.create_task(server.serve())
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.05)
    _print_banner(ccfg, fcfg, token_generated)
    planner = connector = None
    if ccfg.planner.enabled:
        planner, connector = await _start_planner(ccfg, app, cluster)
    await asyncio.wait({serve_task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if planner is not None:  # planner first, then its connector, then the workers
        await planner.close()
        await connector.close()
    server.should_exit = True
    await serve_task
    await cluster.stop()
    if not ccfg.ray.enabled:  # RayCluster.stop closed its own
        await discovery.close()
    return 0


def _print_banner(ccfg: ClusterConfig, fcfg: FrontendConfig, token_generated: bool) -> None:
    base = f"{'https' if fcfg.security.tls_cert_file else 'http'}://{fcfg.host}:{fcfg.port}"
    dash = f"{base}/dashboard" + (f"#token={fcfg.security.admin_token}" if token_generated else "")
    sizes = (f"{ccfg.prefill_workers} prefill + {ccfg.decode_workers} decode ({ccfg.flavor} hand-off)"
             if ccfg.prefill_workers or ccfg.decode_workers else str(ccfg.workers))
    keys = "  (API keys required)" if fcfg.security.api_keys_file else "  (no API key needed)"
    from orchestrator.security import redact

    # the generated admin token is shown once, in the dashboard URL; everything else is redacted like the logs
    print(redact(f"\nkvyard is up: {sizes} × {ccfg.backend}{' (Ray actors)' if ccfg.ray.enabled else ''} serving model "
                 f"'{ccfg.served_model_name}'\n"
                 f"  OpenAI endpoint  {base}/v1{keys}\n  dashboard        ") + (dash if token_generated else redact(dash))
          + redact(f"\n  metrics          {base}/metrics\n"
                   + (f"  KServe v2 gRPC   {fcfg.host}:{fcfg.grpc_port}\n" if fcfg.grpc_port else "") +
                   f"  engine logs      {ccfg.log_dir}/\nPress Ctrl-C to stop."), flush=True)


async def _start_planner(ccfg: ClusterConfig, app, cluster):
    from orchestrator.local_scaling import local_connector
    from planner.config import PlannerConfig
    from planner.service import embedded_planner
    from planner.telemetry.schema import PoolKey
    from planner.telemetry.targets import TargetsConflictError, parse_targets

    # the sim's step times come from a profile, so SLA sizing applies; real vLLM on a CPU has no profile
    sim = ccfg.backend == "sim"
    pcfg = PlannerConfig(interval_s=ccfg.planner.interval_s, advisory=ccfg.planner.advisory,
                         mode="hybrid" if sim else "load", **({"default_profile": ccfg.model} if sim else {}))
    connector = cluster.connector if ccfg.ray.enabled else local_connector(cluster)
    pools = sorted(await connector.get_replicas()) or [PoolKey(ccfg.served_model_name, "both")]  # one per role started
    try:  # bounds to start from; the dashboard or PUT /admin/targets adds TTFT/ITL/tokens-per-second targets
        await app.state.targets.put(parse_targets({"pools": [{"model": p.model, "role": p.role, "min_replicas": 1,
                                                              "max_replicas": max(ccfg.workers, 4)} for p in pools]}),
                                    expected_version=0, actor="kvyard up")
    except TargetsConflictError:
        pass  # targets already stored (shared Redis): keep them
    planner, _, _ = embedded_planner(pcfg, connector, telemetry=app.state.telemetry_store, targets=app.state.targets)
    planner.start()
    print(f"  planner          every {pcfg.interval_s:.0f}s, mode {pcfg.mode}{' (advisory)' if pcfg.advisory else ''};"
          " set targets on the dashboard or PUT /admin/targets", flush=True)
    return planner, connector


def worker_setup(cfg: WorkerConfig, run_dir: Path | None = None):
    """`kvyard worker`'s backend, engine launch config and worker options from its config (no I/O). `run_dir`: the
    private folder of a loopback engine's KV-event ipc:// sockets (orchestrator/launcher.py kv_event_endpoints)."""
    from orchestrator.disagg.launch import kv_connector_of, pd_registration, role_args
    from orchestrator.launcher import default_tokenizer, device_of, kv_event_endpoints
    from workers.registry import create_backend
    from workers.types import EngineLaunchConfig
    from workers.worker import WorkerOptions

    kv_port = cfg.kv_events_port or cfg.port + 1000
    events, replay = kv_event_endpoints(cfg.host, kv_port, run_dir or Path(tempfile.gettempdir()) / "kvyard-worker")
    extra = list(cfg.engine_args)
    extra = role_args(cfg.backend, cfg.role, extra) + extra  # e.g. SGLang's --disaggregation-mode, unless given
    launch = EngineLaunchConfig(model=cfg.model, served_model_name=cfg.served_model_name, host=cfg.host, port=cfg.port,
                                block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                                kv_events_endpoint=events, kv_replay_endpoint=replay,
                                python=cfg.engine_python, extra_args=extra, cpus=cfg.engine_cpus,
                                engine_cmd=cfg.engine_cmd, role=cfg.role.value)
    backend = create_backend(cfg.backend, device_of(cfg.device if cfg.device != "auto" else None))
    opts = WorkerOptions(
        role=cfg.role, lease_ttl_s=cfg.lease_ttl_s, drain_timeout_s=cfg.drain_timeout_s,
        start_timeout_s=cfg.engine_start_timeout_s, advertise_host=cfg.advertise_host or cfg.host,
        tokenizer=default_tokenizer(cfg.backend, cfg.model, cfg.tokenizer),
        labels={"kv_connector": c} if (c := kv_connector_of(extra)) else {},
        **dict(zip(("pd_protocol", "bootstrap_port"), pd_registration(cfg.backend, extra))))
    return backend, launch, opts


async def run_worker(cfg: WorkerConfig) -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="kvyard-worker-"))  # 0700: the KV-event ipc:// sockets of a loopback engine
    try:
        return await _serve_worker(cfg, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


async def _serve_worker(cfg: WorkerConfig, run_dir: Path) -> int:
    from workers.discovery import RedisDiscovery
    from workers.process import EngineStartError
    from workers.worker import WorkerSupervisor

    backend, launch, opts = worker_setup(cfg, run_dir)
    discovery = RedisDiscovery(cfg.redis_url, prefix=cfg.discovery_prefix, secret=cfg.registry_secret)
    sup = WorkerSupervisor(backend, launch, discovery, opts)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop)
    try:
        await sup.start()
    except EngineStartError as exc:  # logged and reported to discovery (/api/cluster) by the supervisor
        await sup.shutdown(drain=False)
        await discovery.close()
        raise SystemExit(f"kvyard: worker {sup.worker_id}: {exc}") from None
    except BaseException:
        await sup.shutdown(drain=False)
        raise
    _say(f"worker {sup.worker_id} ready at {sup.info.url}")
    code = await sup.run()
    await discovery.close()
    return code


async def run_frontend(cfg: FrontendConfig) -> int:
    from orchestrator.app import create_app

    if not cfg.redis_url:  # without a registry it would serve nothing while looking alive
        raise SystemExit("kvyard frontend: --redis-url (or KVYARD_REDIS_URL) is required: the frontend finds its workers in "
                         "Redis. For a self-contained local cluster (engines, frontend and in-memory registry in one "
                         "process), run `kvyard up`.")
    server = await _serve(create_app(cfg, owns_process=True), cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    grpc_note = f", gRPC on {cfg.host}:{cfg.grpc_port}" if cfg.grpc_port else ""
    scheme = "https" if cfg.security.tls_cert_file else "http"
    _say(f"kvyard frontend on {scheme}://{cfg.host}:{cfg.port}/v1{grpc_note} (discovery: {cfg.redis_url})")
    await server.serve()
    return 0
