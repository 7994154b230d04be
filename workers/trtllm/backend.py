"""`TrtllmBackend`: how kvyard starts TensorRT-LLM's `trtllm-serve` and reads what it publishes.

Command (`tensorrt_llm/commands/serve.py`; the flags are checked against trtllm-serve's option list in
tests/unit/workers/trtllm/test_trtllm_surface.py):

    trtllm-serve <model> --host H --port P --max_seq_len <max model len> --max_batch_size <max seqs>
        --max_num_tokens <token budget per step> --extra_llm_api_options <kvyard's YAML>

The YAML (LLM API options, `tensorrt_llm/llmapi/llm_args.py`) that kvyard writes:

    kv_cache_config: {enable_block_reuse: true, event_buffer_max_size: 10000, tokens_per_block: <block size>}
    enable_iter_perf_stats: true          # JSON iteration stats on GET /metrics
    return_perf_metrics: true             # Prometheus GET /prometheus/metrics (what frontends scrape)
    cache_transceiver_config: {backend: DEFAULT}     # prefill / decode roles only (P/D hand-off)

merged under the user's own `--extra_llm_api_options FILE` (given in the engine args: its keys win,
nested maps merged), which is then replaced by the merged file. P/D roles need nothing else: each
request's `disaggregated_params.request_type` (context_only / generation_only) picks the phase.

KV events: trtllm-serve has no ZMQ publisher, only `POST /kv_cache_events`, which *drains* the engine's
queue. So one reader, the worker process, polls it and republishes every event on the worker's ZMQ
endpoint in vLLM's wire format with a replay socket (workers/trtllm/relay.py); frontends subscribe to
that, as many as there are. `kv_events_transport = "http-relay"` tells the worker to start the relay.
`EngineLaunchConfig.engine_cmd` replaces `trtllm-serve` (the flags stay), e.g. to run the sim in its
TRT-LLM flavor through this code.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from router.kv_events import KvEventBatch
from workers.trtllm.metrics import parse_trtllm_metrics
from workers.types import EngineLaunchConfig, EngineMetrics, LaunchSpec
from workers.vllm.kv_events import decode_pub_frames

__all__ = ["EVENT_BUFFER", "EXTRA_OPTIONS_FLAGS", "TrtllmBackend", "TrtllmLaunchError", "llm_api_options", "merge_options",
           "server_args"]

EVENT_BUFFER = 10000  # events trtllm-serve keeps between two polls of the worker's relay (0.1 s apart)
EXTRA_OPTIONS_FLAGS = ("--extra_llm_api_options", "--config")  # trtllm-serve's two names for the YAML


class TrtllmLaunchError(ValueError):
    """The launch config cannot work with TensorRT-LLM."""


def llm_api_options(cfg: EngineLaunchConfig) -> dict[str, Any]:
    """kvyard's part of the `--extra_llm_api_options` YAML."""
    out: dict[str, Any] = {
        "kv_cache_config": {"enable_block_reuse": True, "event_buffer_max_size": EVENT_BUFFER, "tokens_per_block": cfg.block_size},
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
    }
    if cfg.role in ("prefill", "decode"):
        out["cache_transceiver_config"] = {"backend": "DEFAULT"}
    return out


def merge_options(base: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """`user` over `base`, nested maps merged key by key."""
    out = dict(base)
    for key, value in user.items():
        out[key] = merge_options(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _split_user_options(extra: list[str]) -> tuple[list[str], str | None]:
    """The engine args without `--extra_llm_api_options FILE` (either spelling, `=` form too), and that FILE."""
    rest: list[str] = []
    path = None
    skip = False
    for i, a in enumerate(extra):
        if skip:
            skip = False
            continue
        flag, eq, value = a.partition("=")
        if flag in EXTRA_OPTIONS_FLAGS:
            if eq:
                path = value
            elif i + 1 < len(extra):
                path, skip = extra[i + 1], True
            else:
                raise TrtllmLaunchError(f"{a} needs a file")
            continue
        rest.append(a)
    return rest, path


def server_args(cfg: EngineLaunchConfig, options_path: str) -> list[str]:
    """trtllm-serve's arguments for a launch config (without the user's extra args)."""
    return [
        cfg.model,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--max_seq_len", str(cfg.max_model_len),
        "--max_batch_size", str(cfg.max_num_seqs),
        "--max_num_tokens", str(cfg.max_num_batched_tokens),
        "--extra_llm_api_options", options_path,
    ]  # fmt: skip


class TrtllmBackend:
    name = "trtllm"
    health_path = "/health"
    metrics_path = "/prometheus/metrics"  # GET /metrics is drained per read: one frontend would starve the others
    kv_events_transport = "http-relay"

    def validate(self, cfg: EngineLaunchConfig) -> None:
        if cfg.block_size <= 0:
            raise TrtllmLaunchError(f"block size (tokens_per_block) must be positive, got {cfg.block_size}")
        if cfg.max_model_len <= 0 or cfg.max_num_seqs <= 0 or cfg.max_num_batched_tokens <= 0:
            raise TrtllmLaunchError("max_model_len, max_num_seqs and max_num_batched_tokens must be positive")

    def options_path(self, cfg: EngineLaunchConfig) -> str:
        """Where kvyard's merged YAML goes: one file per engine (host, port)."""
        return str(Path(tempfile.gettempdir()) / f"kvyard-trtllm-{cfg.host}-{cfg.port}" / "extra-llm-api-options.yaml")

    def launch_spec(self, cfg: EngineLaunchConfig) -> LaunchSpec:
        self.validate(cfg)
        extra, user_file = _split_user_options(list(cfg.extra_args))
        options = llm_api_options(cfg)
        if user_file is not None:
            try:
                user = yaml.safe_load(Path(user_file).read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise TrtllmLaunchError(f"cannot read --extra_llm_api_options {user_file}: {exc}") from exc
            if not isinstance(user, dict):
                raise TrtllmLaunchError(f"--extra_llm_api_options {user_file}: top level must be a mapping")
            options = merge_options(options, user)
        path = self.options_path(cfg)
        if cfg.engine_cmd:
            program = list(cfg.engine_cmd)
        elif cfg.python and "/" in cfg.python:  # the console script beside the given interpreter
            program = [str(Path(cfg.python).parent / "trtllm-serve")]
        else:
            program = [shutil.which("trtllm-serve") or "trtllm-serve"]
        argv = [*program, *server_args(cfg, path), *extra]
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRTLLM_NO_USAGE_STATS": "1", **cfg.env}
        return LaunchSpec(argv=argv, env=env, files={path: yaml.safe_dump(options, sort_keys=True)})

    def parse_metrics(self, text: str) -> EngineMetrics:
        return parse_trtllm_metrics(text)

    def decode_kv_frames(self, frames: list[bytes]) -> KvEventBatch:
        """Frames off the worker's relay socket: vLLM's wire format (workers/trtllm/relay.py)."""
        return decode_pub_frames(frames)
