"""`kvyard planner`: the planner process (flags and YAML are read here, the entry point).

    kvyard planner --redis-url redis://... [--discovery-prefix kvyard] --config planner.yaml
                   [--connector kubernetes|virtual] [--advisory] [--metrics-port 9090]
YAML (what the Helm chart's planner ConfigMap renders):
    connector: kubernetes            # or virtual (records only)
    metrics_port: 9090               # Prometheus /metrics of the planner (0: off)
    metrics_host: 0.0.0.0
    planner: {...}                   # planner.config.PlannerConfig
    targets: {...}                   # initial Targets, stored only if none are set yet
    kubernetes: {namespace: ns, in_cluster: true, deployments: [{model, role, deployment}, ...]}
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

__all__ = ["add_planner_parser", "run_planner_command"]

log = logging.getLogger("kvyard.planner")


def add_planner_parser(sub) -> argparse.ArgumentParser:
    pl = sub.add_parser("planner", help="scale worker pools against the targets stored in Redis")
    pl.add_argument("--redis-url", default=os.environ.get("KVYARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    pl.add_argument("--discovery-prefix", default="kvyard", help="Redis key prefix (one per cluster)")
    pl.add_argument("--config", help="YAML file (see `kvyard planner --help`)")
    pl.add_argument("--connector", default=None, choices=["kubernetes", "virtual"])
    pl.add_argument("--advisory", action="store_true", default=None, help="decide and record, never apply")
    pl.add_argument("--metrics-port", type=int, default=None)
    return pl


async def _seed_targets(store, data: dict | None) -> None:
    from planner.telemetry.targets import TargetsConflictError, parse_targets

    if not data:
        return
    try:
        vt = await store.put(parse_targets(data), expected_version=0, actor="planner-config")
        log.info("initial targets stored as version %d", vt.version)
    except TargetsConflictError:
        log.info("targets already set in Redis; the config's initial targets are not applied")


def _connector(name: str, doc: dict, pools):
    from planner.connectors import VirtualConnector
    from planner.telemetry.schema import PoolKey

    if name == "virtual":
        return VirtualConnector({p: 0 for p in pools})
    from planner.connectors.kubernetes import KubernetesConnector

    k = doc.get("kubernetes") or {}
    names = {PoolKey(d["model"], d["role"]): d["deployment"] for d in k.get("deployments", [])}
    return KubernetesConnector.from_kubeconfig(sorted(set(pools) | set(names)), k.get("namespace", "default"),
                                               in_cluster=k.get("in_cluster", True), deployments=names)


async def run_planner_command(ns: argparse.Namespace, stop: asyncio.Event | None = None) -> int:
    from prometheus_client import REGISTRY, start_http_server

    from orchestrator.config import load_yaml
    from planner.config import PlannerConfig
    from planner.service import run_planner
    from planner.telemetry.schema import PoolKey
    from planner.telemetry.targets import RedisTargetsStore

    doc = load_yaml(ns.config) if ns.config else {}
    cfg_data = dict(doc.get("planner") or {})
    if ns.advisory:
        cfg_data["advisory"] = True
    cfg = PlannerConfig(**cfg_data)
    targets_doc = doc.get("targets") or {}
    pools = [PoolKey(p["model"], p.get("role", "both")) for p in targets_doc.get("pools", [])]
    connector = _connector(ns.connector or doc.get("connector", "kubernetes"), doc, pools)
    seed = RedisTargetsStore(ns.redis_url, prefix=ns.discovery_prefix)
    try:
        await _seed_targets(seed, targets_doc)
    finally:
        await seed.close()
    port = ns.metrics_port if ns.metrics_port is not None else int(doc.get("metrics_port", 0))
    if port:
        start_http_server(port, addr=doc.get("metrics_host", "0.0.0.0"), registry=REGISTRY)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    print(f"kvyard planner: {cfg.mode} mode, {connector.name} connector, every {cfg.interval_s:.0f} s"
          f"{' (advisory)' if cfg.advisory else ''}", flush=True)
    return await run_planner(cfg, ns.redis_url, connector, prefix=ns.discovery_prefix, registry=REGISTRY if port else None, stop=stop)
