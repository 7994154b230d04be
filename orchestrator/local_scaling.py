"""Planner connector for `kvyard up`: a LocalConnector over a running LocalCluster.

`local_connector(cluster)` adopts the cluster's workers (pool = (served model name, role)) and builds
new ones with the cluster's own `make_supervisor` (engine config i, the role's disaggregation flags,
its discovery, its tokenizer, a log per worker), numbering on after the cluster's own. Scale-down drains (see planner/connectors/local.py).
Shut down in this order: planner loop, `await connector.close()`, then `await cluster.stop()`.
"""

from __future__ import annotations

from orchestrator.launcher import LocalCluster, default_tokenizer
from planner.connectors.local import LocalConnector
from planner.telemetry.schema import PoolKey
from workers.types import WorkerRole
from workers.worker import WorkerSupervisor

__all__ = ["local_connector"]


def local_connector(cluster: LocalCluster) -> LocalConnector:
    cfg = cluster.cfg
    tok = default_tokenizer(cfg.backend, cfg.model, cfg.tokenizer)

    def factory(pool: PoolKey, i: int) -> WorkerSupervisor:
        return cluster.make_supervisor(i, WorkerRole(pool.role), tok)  # a prefill/decode worker gets its hand-off flags too

    conn = LocalConnector(factory, first_ordinal=len(cluster.supervisors))
    for sup, task in cluster.running():
        conn.adopt(PoolKey(cfg.served_model_name, sup.opts.role.value), sup, task)
    return conn
