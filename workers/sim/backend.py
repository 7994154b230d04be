"""`SimBackend`: kvyard's Backend for the simulated engine (`python -m workers.sim`).

The sim speaks vLLM 0.32's protocol, so metrics parsing and KV-event decoding are vLLM's. For the sim,
`EngineLaunchConfig.model` is the profile name (or a profile directory); KV-event settings become a
vLLM `--kv-events-config` JSON; `extra_args` are appended (e.g. `["--speedup", "10"]`). The frontend
tokenizes with the bundled tokenizer at `SIM_TOKENIZER_DIR`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from workers.kv_events import KvEventBatch
from workers.types import EngineLaunchConfig, EngineMetrics, LaunchSpec
from workers.vllm.kv_events import decode_pub_frames

__all__ = ["SIM_TOKENIZER_DIR", "SimBackend", "sim_tokenizer_path"]

SIM_TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"


def sim_tokenizer_path() -> str:
    """Folder holding the sim's tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    return str(SIM_TOKENIZER_DIR)


class SimBackend:
    name = "sim"
    health_path = "/health"

    def launch_spec(self, cfg: EngineLaunchConfig) -> LaunchSpec:
        argv = [
            cfg.python or sys.executable, "-m", "workers.sim",
            "--host", cfg.host,
            "--port", str(cfg.port),
            "--model", cfg.model,
            "--served-model-name", cfg.served_model_name,
            "--block-size", str(cfg.block_size),
            "--max-model-len", str(cfg.max_model_len),
            "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
        ]
        if cfg.kv_events_endpoint:
            kv = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": cfg.kv_events_endpoint,
                "replay_endpoint": cfg.kv_replay_endpoint,
                "topic": cfg.kv_events_topic,
            }
            argv += ["--kv-events-config", json.dumps(kv)]
        argv += list(cfg.extra_args)
        return LaunchSpec(argv=argv, env=dict(cfg.env))

    def parse_metrics(self, text: str) -> EngineMetrics:
        from workers.vllm.metrics import parse_vllm_metrics  # the sim exposes vLLM's metric names

        return parse_vllm_metrics(text)

    def decode_kv_frames(self, frames: list[bytes]) -> KvEventBatch:
        return decode_pub_frames(frames)
