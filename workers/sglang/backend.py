"""`SglangBackend`: how kvyard starts an SGLang server and reads what it publishes.

Command (SGLang 0.5.23's `ServerArgs`; every flag is checked by SGLang's own parser in
tests/unit/workers/sglang/test_sglang_server_args.py):

    <python> -m sglang.launch_server --model-path M --served-model-name N --host H --port P
        --page-size <block size> --context-length <max model len> --max-running-requests <max seqs>
        --chunked-prefill-size <token budget per step> --enable-metrics
        --kv-events-config '{"publisher":"zmq","endpoint":E,"replay_endpoint":R,"topic":T}'
        [--device cpu --attention-backend torch_native]                            (device cpu)
        [--disaggregation-mode prefill|decode [--disaggregation-bootstrap-port B]]  (P/D roles, added by
                                                                                      orchestrator/disagg/launch.py)
        <the user's engine args>                                                    (last: they win)

Page size is kvyard's block size, so SGLang's one-event-per-page KV events line up with the router's
blocks. SGLang's KV-events config has no `enable_kv_cache_events`: `"publisher":"zmq"` turns it on;
its PUB and replay sockets bind `tcp://*:port` and `ipc://` endpoints themselves. Health is `/health`,
metrics `/metrics` (`sglang:*`, workers/sglang/metrics.py), KV events are decoded by
workers/sglang/kv_events.py. `EngineLaunchConfig.engine_cmd` replaces `<python> -m
sglang.launch_server` (the flags stay), e.g. to run the sim in its SGLang flavor through this code.
"""

from __future__ import annotations

import json

from workers.engine_env import find_venv_python
from router.kv_events import KvEventBatch
from workers.sglang.kv_events import decode_pub_frames
from workers.sglang.metrics import parse_sglang_metrics
from workers.types import EngineLaunchConfig, EngineMetrics, LaunchSpec

__all__ = ["SGLANG_VENV", "SglangBackend", "SglangLaunchError", "kv_events_config", "server_args"]

SGLANG_VENV = ".venv-sglang"
LAUNCH_MODULE = "sglang.launch_server"


class SglangLaunchError(ValueError):
    """The launch config cannot work with SGLang."""


def kv_events_config(cfg: EngineLaunchConfig) -> dict[str, object] | None:
    """SGLang's `--kv-events-config` JSON for the launch config, or None when events are off."""
    if not cfg.kv_events_endpoint:
        return None
    config: dict[str, object] = {"publisher": "zmq", "endpoint": cfg.kv_events_endpoint, "topic": cfg.kv_events_topic}
    if cfg.kv_replay_endpoint:
        config["replay_endpoint"] = cfg.kv_replay_endpoint
    return config


def server_args(cfg: EngineLaunchConfig) -> list[str]:
    """The SGLang server flags for a launch config (without device flags or the user's extra args)."""
    argv = [
        "--model-path", cfg.model,
        "--served-model-name", cfg.served_model_name,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--page-size", str(cfg.block_size),
        "--context-length", str(cfg.max_model_len),
        "--max-running-requests", str(cfg.max_num_seqs),
        "--chunked-prefill-size", str(cfg.max_num_batched_tokens),
        "--enable-metrics",
    ]  # fmt: skip
    events = kv_events_config(cfg)
    if events is not None:
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    return argv


class SglangBackend:
    name = "sglang"
    health_path = "/health"
    metrics_path = "/metrics"

    def __init__(self, device: str = "cuda") -> None:
        if device not in ("cpu", "cuda"):
            raise SglangLaunchError(f"unknown SGLang device {device!r}; expected 'cpu' or 'cuda'")
        self.device = device

    def validate(self, cfg: EngineLaunchConfig) -> None:
        if cfg.block_size <= 0:
            raise SglangLaunchError(f"block (page) size must be positive, got {cfg.block_size}")
        if cfg.max_model_len <= 0 or cfg.max_num_seqs <= 0 or cfg.max_num_batched_tokens <= 0:
            raise SglangLaunchError("max_model_len, max_num_seqs and max_num_batched_tokens must be positive")
        if cfg.kv_replay_endpoint and not cfg.kv_events_endpoint:
            raise SglangLaunchError("a KV replay endpoint needs a KV events endpoint")

    def launch_spec(self, cfg: EngineLaunchConfig) -> LaunchSpec:
        self.validate(cfg)
        program = cfg.engine_cmd or [cfg.python or find_venv_python(SGLANG_VENV, "scripts/install_sglang.sh"), "-m", LAUNCH_MODULE]
        argv = [*program, *server_args(cfg)]
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}
        if self.device == "cpu":
            argv += ["--device", "cpu", "--attention-backend", "torch_native"]
        argv += list(cfg.extra_args)  # last, so they override ours (argparse keeps the last value)
        env.update(cfg.env)
        return LaunchSpec(argv=argv, env=env)

    def parse_metrics(self, text: str) -> EngineMetrics:
        return parse_sglang_metrics(text)

    def decode_kv_frames(self, frames: list[bytes]) -> KvEventBatch:
        return decode_pub_frames(frames)
