"""`kvyard up` moves an engine off a port something else holds instead of failing the whole start."""

from __future__ import annotations

import socket

from orchestrator.config import ClusterConfig
from orchestrator.launcher import LocalCluster, port_is_free
from workers.discovery import InMemoryDiscovery


def _free_run(n: int) -> int:
    """A base port whose next n ports are all free now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535 and all(port_is_free(p) for p in range(base, base + n)):
            return base


def test_engine_ports_skip_a_port_in_use(tmp_path) -> None:
    base = _free_run(4)
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 1))
        held.listen()
        assert not port_is_free(base + 1)
        cluster = LocalCluster(ClusterConfig(workers=3, backend="sim", base_port=base, log_dir=tmp_path), InMemoryDiscovery())
        ports = [cluster.engine_port(i) for i in range(3)]
        assert ports == [base, base + 2, base + 3]
        assert cluster.engine_port(1) == base + 2  # stable once given
        assert cluster._engine_cfg(1).port == base + 2


def test_engine_ports_skip_the_frontends_ports(tmp_path) -> None:
    """`kvyard up --port P --base-port P` (or a gRPC port in the engines' range): the engines start before the
    frontend binds, so a free check alone would give P to worker 0 and the frontend would then fail to bind."""
    base = _free_run(5)
    cfg = ClusterConfig(workers=3, backend="sim", base_port=base, log_dir=tmp_path,
                        frontend={"port": base, "grpc_port": base + 2})
    cluster = LocalCluster(cfg, InMemoryDiscovery())
    assert [cluster.engine_port(i) for i in range(3)] == [base + 1, base + 3, base + 4]
