"""CLI: flags override YAML, YAML overrides defaults."""

from __future__ import annotations

import pytest

from orchestrator.cli import _build_parser, _frontend_config, main
from orchestrator.config import FrontendConfig


def test_frontend_defaults_without_flags_or_yaml():
    ns = _build_parser().parse_args(["frontend"])
    cfg = _frontend_config(ns)
    assert (cfg.host, cfg.port, cfg.policy) == ("127.0.0.1", 8000, "kv")


def test_yaml_then_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("frontend:\n  port: 9001\n  policy: random\n  max_body_bytes: 1234\n")
    cfg = _frontend_config(_build_parser().parse_args(["frontend", "--config", str(y)]))
    assert (cfg.port, cfg.policy, cfg.max_body_bytes) == (9001, "random", 1234)
    cfg = _frontend_config(_build_parser().parse_args(["frontend", "--config", str(y), "--port", "9002"]))
    assert (cfg.port, cfg.policy) == (9002, "random")
    assert isinstance(cfg, FrontendConfig)


def test_worker_flags_parse():
    ns = _build_parser().parse_args(["worker", "--backend", "sim", "--model", "h200-llama3.1-8b", "--served-model-name", "m",
                                     "--", "--speedup", "4"])
    assert ns.engine_args[-2:] == ["--speedup", "4"] and ns.device == "auto"


@pytest.mark.parametrize("yaml_text,field", [("engine_cpus: '3-2'\n", "engine_cpus"), ("workers: 0\n", "workers"),
                                             ("frontend:\n  max_body_bytes: -1\n", "max_body_bytes")])
def test_a_bad_config_value_is_a_clear_error(tmp_path, yaml_text, field):
    y = tmp_path / "c.yaml"
    y.write_text(yaml_text)
    with pytest.raises(SystemExit) as exc:
        main(["up", "--config", str(y), "--port", "0"])
    assert str(exc.value).startswith("kvyard: bad configuration:") and field in str(exc.value)
