"""SglangBackend: its command line, device flags, engine-command override, role flags and metrics parser.

That SGLang's own parser accepts this command line is checked in tests/integration/test_sglang_engine_classes.py
(it needs .venv-sglang)."""

from __future__ import annotations

import json

import pytest

from orchestrator.disagg.launch import pd_registration, role_args
from workers.registry import create_backend, get_backend
from workers.sglang.backend import SglangBackend, SglangLaunchError
from workers.sglang.metrics import parse_sglang_metrics
from workers.types import EngineLaunchConfig, WorkerRole


def cfg(**kw) -> EngineLaunchConfig:
    base = dict(model="/m", served_model_name="tiny", port=30000, block_size=16, max_model_len=4096, kv_events_endpoint="ipc:///tmp/x.sock",
                python="/venv/bin/python")
    return EngineLaunchConfig(**{**base, **kw})


def test_command_line() -> None:
    argv = SglangBackend("cuda").launch_spec(cfg(extra_args=["--tp-size", "2"])).argv
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"] and argv[-2:] == ["--tp-size", "2"]
    args = dict(zip(argv[3::2], argv[4::2]))
    assert (args["--model-path"], args["--served-model-name"], args["--page-size"], args["--context-length"]) == ("/m", "tiny", "16", "4096")
    assert "--enable-metrics" in argv and "--device" not in argv
    i = argv.index("--kv-events-config")
    assert json.loads(argv[i + 1]) == {"publisher": "zmq", "endpoint": "ipc:///tmp/x.sock", "topic": "kv-events"}
    cpu = SglangBackend("cpu").launch_spec(cfg()).argv
    assert cpu[cpu.index("--device") + 1] == "cpu" and cpu[cpu.index("--attention-backend") + 1] == "torch_native"
    assert "--kv-events-config" not in SglangBackend().launch_spec(cfg(kv_events_endpoint=None)).argv


def test_engine_cmd_replaces_only_the_program() -> None:
    argv = SglangBackend().launch_spec(cfg(engine_cmd=["python", "-m", "workers.sim", "--flavor", "sglang"])).argv
    assert argv[:6] == ["python", "-m", "workers.sim", "--flavor", "sglang", "--model-path"]


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(max_num_seqs=0), dict(kv_events_endpoint=None, kv_replay_endpoint="ipc:///r")])
def test_bad_configs_are_refused(bad: dict) -> None:
    with pytest.raises(SglangLaunchError):
        SglangBackend().launch_spec(cfg(**bad))
    with pytest.raises(SglangLaunchError):
        SglangBackend("tpu")


def test_role_flags_for_kvyard_worker() -> None:
    assert role_args("sglang", WorkerRole.PREFILL, []) == ["--disaggregation-mode", "prefill"]
    assert role_args("sglang", WorkerRole.DECODE, ["--disaggregation-mode=decode"]) == []  # given: kept as is
    assert role_args("sglang", WorkerRole.BOTH, []) == [] and role_args("vllm", WorkerRole.PREFILL, []) == []
    assert pd_registration("sglang", ["--disaggregation-mode", "prefill"]) == (None, 8998)
    assert pd_registration("sglang", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001"]) == (None, 9001)


def test_registry_and_metrics() -> None:
    assert get_backend("sglang").metrics_path == "/metrics" and create_backend("sglang", "cpu").device == "cpu"
    text = ('sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 2.0\n'
            'sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="1"} 1.0\n'
            'sglang:num_queue_reqs{tp_rank="0"} 4.0\nsglang:num_decode_transfer_queue_reqs{tp_rank="0"} 1.0\n'
            'sglang:token_usage{tp_rank="0"} 0.5\nsglang:token_usage{tp_rank="1"} 0.25\n'
            'sglang:prompt_tokens_total{tp_rank="0"} 100.0\nsglang:cached_tokens_total{tp_rank="0"} 40.0\n'
            'sglang:generation_tokens_total{tp_rank="0"} 7.0\nsglang:gen_throughput{tp_rank="0"} NaN\nsglang:bad_line\n')
    m = parse_sglang_metrics(text)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (3.0, 5.0, 0.375)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.generation_tokens) == (100.0, 40.0, 7.0)
    assert parse_sglang_metrics(None).num_requests_running == 0.0  # type: ignore[arg-type]


def test_metrics_with_timestamps_and_odd_labels() -> None:
    text = ('sglang:num_running_reqs{model_name="a} \\"b\\"",tp_rank="0"} 2.0 1765000000000\n'
            "sglang:num_running_reqs{tp_rank=\"1\"} 1\n"
            "sglang:num_queue_reqs 4 1765000000000\n")
    m = parse_sglang_metrics(text)
    assert (m.num_requests_running, m.num_requests_waiting) == (3.0, 4.0)  # the values, not the timestamps
