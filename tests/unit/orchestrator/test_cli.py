"""CLI and config tree: defaults < YAML < environment < flags < --set; flags, docs and library defaults agree with
the models."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import (
    FRONTEND_FLAGS,
    REFERENCE_ROOTS,
    UP_FLAGS,
    WORKER_FLAGS,
    build_parser,
    cluster_config,
    frontend_config,
    main,
    worker_config,
)
from orchestrator.config import ClusterConfig, FrontendConfig, FrontendFile, WorkerConfig
from orchestrator.config.loading import field_at, reference_markdown

REPO = Path(__file__).resolve().parents[3]


def test_frontend_defaults_without_flags_or_yaml():
    cfg = frontend_config(build_parser().parse_args(["frontend"]), environ={})
    assert (cfg.host, cfg.port, cfg.grpc_port, cfg.router.policy) == ("127.0.0.1", 8000, 8001, "kv")
    assert cfg == FrontendConfig()


def test_yaml_then_flags_then_set(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("frontend:\n  port: 9001\n  router: {policy: random}\n  max_body_bytes: 1234\n")
    parse = build_parser().parse_args
    cfg = frontend_config(parse(["frontend", "--config", str(y)]), environ={})
    assert (cfg.port, cfg.router.policy, cfg.max_body_bytes) == (9001, "random", 1234)
    cfg = frontend_config(parse(["frontend", "--config", str(y), "--port", "9002", "--policy", "kv"]), environ={})
    assert (cfg.port, cfg.router.policy) == (9002, "kv")
    cfg = frontend_config(parse(["frontend", "--config", str(y), "--port", "9002",
                                 "--set", "frontend.port=9003", "--set", "frontend.router.kv.overlap_weight=4"]), environ={})
    assert (cfg.port, cfg.router.kv.overlap_weight) == (9003, 4.0)


def test_environment_sits_between_yaml_and_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("frontend:\n  redis_url: redis://yaml:6379/0\n")
    env = {"KVYARD_REDIS_URL": "redis://env:6379/0", "KVYARD_ADMIN_TOKEN": "tok"}
    cfg = frontend_config(build_parser().parse_args(["frontend", "--config", str(y)]), environ=env)
    assert cfg.redis_url == "redis://env:6379/0" and cfg.security.admin_token == "tok"
    cfg = frontend_config(build_parser().parse_args(["frontend", "--redis-url", "redis://flag:6379/0"]), environ=env)
    assert cfg.redis_url == "redis://flag:6379/0"


def test_worker_builds_a_typed_config():
    ns = build_parser().parse_args(["worker", "--backend", "sim", "--model", "h200-llama3.1-8b", "--served-model-name", "m",
                                    "--role", "decode", "--", "--speedup", "4"])
    cfg = worker_config(ns, environ={})
    assert isinstance(cfg, WorkerConfig) and cfg.engine_args == ["--speedup", "4"] and cfg.device == "auto"
    assert cfg.role.value == "decode" and cfg.max_model_len == ClusterConfig().max_model_len


@pytest.mark.parametrize("yaml_text,field", [("engine_cpus: '3-2'\n", "engine_cpus"), ("workers: 0\n", "workers"),
                                             ("frontend:\n  max_body_bytes: -1\n", "max_body_bytes"),
                                             ("frontend:\n  max_body_byte: 10\n", "max_body_byte"),  # a typo
                                             ("frontend:\n  router: {kv: {overlap_wieght: 2}}\n", "overlap_wieght")])
def test_a_bad_config_value_is_a_clear_error(tmp_path, yaml_text, field):
    y = tmp_path / "c.yaml"
    y.write_text(yaml_text)
    with pytest.raises(SystemExit) as exc:
        main(["up", "--config", str(y), "--port", "0"])
    assert str(exc.value).startswith("kvyard: bad configuration:") and field in str(exc.value)


def test_a_bad_set_item_is_a_clear_error():
    with pytest.raises(SystemExit) as exc:
        main(["config", "show", "--set", "no-equals-sign"])
    assert "PATH=VALUE" in str(exc.value)


@pytest.mark.parametrize("flags,root", [(UP_FLAGS, ClusterConfig), (WORKER_FLAGS, WorkerConfig), (FRONTEND_FLAGS, FrontendFile)])
def test_every_flag_names_a_field_and_defers_to_its_default(flags, root):
    parser = build_parser()
    for f in flags:
        info = field_at(root, f.path)  # KeyError: a flag for no field
        assert info.description, f.path
    sub = {ClusterConfig: "up", WorkerConfig: "worker", FrontendFile: "frontend"}[root]
    ns = parser.parse_args([sub] + (["--backend", "sim"] if sub == "worker" else []))
    assert all(getattr(ns, f.dest) is None for f in flags if f.option != "--backend")


def test_every_field_has_a_description():
    from orchestrator.config.loading import _walk

    for root in (ClusterConfig, WorkerConfig):
        for path, info, _ in _walk(root, ""):
            assert info.description, path


def test_the_configuration_reference_is_current():
    roots = {**REFERENCE_ROOTS, "kvyard frontend (`--config` file)": FrontendFile}
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed.strip() == reference_markdown(roots).strip(), "stale: kvyard config reference > docs/configuration.md"


def test_library_defaults_equal_the_configs():
    from router import LoadTracker, build_policy
    from router.kv_index import KvIndex
    from workers.types import EngineLaunchConfig
    from workers.worker import WorkerOptions

    kv = FrontendConfig().router.kv
    scorer = build_policy("kv").scorers[0][0]
    assert (scorer.overlap_weight, scorer.reuse_weight, scorer.request_weight) == (kv.overlap_weight, kv.reuse_weight,
                                                                                   kv.request_weight)
    assert build_policy("kv").index.pending_ttl_s == KvIndex().pending_ttl_s == kv.pending_ttl_s
    assert LoadTracker().drain is kv.prefill_drain
    w = WorkerConfig(backend="sim")
    opts = WorkerOptions()
    assert (opts.lease_ttl_s, opts.drain_timeout_s, opts.start_timeout_s) == (w.lease_ttl_s, w.drain_timeout_s,
                                                                              w.engine_start_timeout_s)
    launch = EngineLaunchConfig(model="m", served_model_name="m")
    assert (launch.block_size, launch.max_model_len) == (w.block_size, w.max_model_len)


def test_the_configs_backends_are_the_registered_ones():
    from typing import get_args

    from orchestrator.config.cluster import BackendName
    from router import policy_names
    from router.config import PolicyName
    from workers.registry import backend_names

    assert sorted(get_args(BackendName)) == backend_names()
    assert sorted(get_args(PolicyName)) == policy_names()
