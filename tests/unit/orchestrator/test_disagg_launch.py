"""Engine flags and registration of prefill/decode workers per flavor (orchestrator/disagg/launch.py), and
the roles `kvyard up --prefill-workers/--decode-workers` starts."""

from __future__ import annotations

import json

import pytest

from orchestrator.config import ClusterConfig
from orchestrator.disagg.launch import pd_launch, pd_registration
from orchestrator.launcher import LocalCluster
from workers.discovery import InMemoryDiscovery
from workers.types import WorkerRole

P, D, B = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH


def ports():
    it = iter(range(7001, 7100))
    return lambda: next(it)


def test_vllm_flags_and_side_channel():
    pd = pd_launch("sim", "vllm", P, ports())
    assert pd.extra_args[:2] == ["--flavor", "vllm"]
    assert json.loads(pd.extra_args[pd.extra_args.index("--kv-transfer-config") + 1]) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert pd.env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "7001"}
    assert (pd.pd_protocol, pd.bootstrap_port) == ("vllm", None)
    real = pd_launch("vllm", "vllm", D, ports())
    assert "--flavor" not in real.extra_args and "--kv-transfer-config" in real.extra_args and real.pd_protocol is None


def test_sglang_flags_and_bootstrap_port():
    pre = pd_launch("sim", "sglang", P, ports())
    assert pre.extra_args == ["--flavor", "sglang", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "7001"]
    assert (pre.pd_protocol, pre.bootstrap_port) == ("sglang", 7001)
    dec = pd_launch("sim", "sglang", D, ports())
    assert dec.extra_args == ["--flavor", "sglang", "--disaggregation-mode", "decode"] and dec.bootstrap_port is None


def test_trtllm_and_both_roles_get_no_handoff_flags():
    assert pd_launch("sim", "trtllm", P, ports()).extra_args == ["--flavor", "trtllm"]
    both = pd_launch("sim", "sglang", B, ports())
    assert both.extra_args == ["--flavor", "sglang"] and both.pd_protocol == "sglang"
    with pytest.raises(ValueError):
        pd_launch("sim", "nixl", P)


@pytest.mark.parametrize("backend, args, expected", [
    ("sim", ["--flavor", "sglang", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001"], ("sglang", 9001)),
    ("sim", ["--flavor=sglang", "--disaggregation-mode", "prefill"], ("sglang", 8998)),
    ("sim", ["--flavor", "trtllm"], ("trtllm", None)),
    ("sim", [], (None, None)),
    ("vllm", ["--kv-transfer-config", "{}"], (None, None)),
])
def test_registration_from_engine_args(backend, args, expected):
    assert pd_registration(backend, args) == expected


def test_cluster_roles_and_registration(tmp_path):
    cfg = ClusterConfig(prefill_workers=1, decode_workers=2, flavor="sglang", log_dir=tmp_path)
    cluster = LocalCluster(cfg, InMemoryDiscovery())
    assert cluster.roles() == [P, D, D]
    sup = cluster.make_supervisor(0, P, None)
    info = sup.build_info()
    assert info.role == P and info.pd_protocol == "sglang" and info.bootstrap_port is not None
    assert sup.cfg.extra_args[-2:] == ["--disaggregation-bootstrap-port", str(info.bootstrap_port)]
    assert LocalCluster(ClusterConfig(workers=3, log_dir=tmp_path), InMemoryDiscovery()).roles() == [B, B, B]


def test_kv_connector_of_engine_args() -> None:
    from orchestrator.disagg.launch import kv_connector_of

    cfg = '{"kv_connector":"ExampleConnector","kv_role":"kv_producer"}'
    assert kv_connector_of(["--max-num-seqs", "4", "--kv-transfer-config", cfg]) == "ExampleConnector"
    assert kv_connector_of([f"--kv-transfer-config={cfg}"]) == "ExampleConnector"
    assert kv_connector_of(["--kv-transfer-config", "not json"]) is None
    assert kv_connector_of(["--kv-transfer-config"]) is None
    assert kv_connector_of([]) is None


def test_vllm_nixl_on_cpu_uses_host_buffers() -> None:
    import json as _json

    from orchestrator.disagg.launch import pd_launch
    from workers.types import WorkerRole

    gpu = pd_launch("vllm", "vllm", WorkerRole.PREFILL, pick_port=lambda: 5601)
    cpu = pd_launch("vllm", "vllm", WorkerRole.DECODE, pick_port=lambda: 5602, kv_buffer_device="cpu")
    assert "kv_buffer_device" not in _json.loads(gpu.extra_args[gpu.extra_args.index("--kv-transfer-config") + 1])
    cfg = _json.loads(cpu.extra_args[cpu.extra_args.index("--kv-transfer-config") + 1])
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    assert cpu.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5602"


def test_free_ports_are_outside_the_ephemeral_range():
    import socket

    from orchestrator.disagg.launch import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not lo <= port <= hi and 1024 <= port < 65536
        with socket.socket() as s:  # free when picked
            s.bind(("127.0.0.1", port))
