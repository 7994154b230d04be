"""`SimBackend`: kvyard's Backend for the simulated engine (`python -m workers.sim`).

The sim speaks vLLM 0.32's protocol, so metrics parsing and KV-event decoding are vLLM's (a sim playing
SGLang or TRT-LLM with `--flavor` is read too: its metrics by their format, and SGLang's KV events
decode with vLLM's decoder, which ignores their extra fields and normalises signed hashes). For the sim,
`EngineLaunchConfig.model` is the profile name (or a profile directory); KV-event settings become a
vLLM `--kv-events-config` JSON; `extra_args` are appended (e.g. `["--speedup", "10"]`). The frontend
tokenizes with the bundled tokenizer at `SIM_TOKENIZER_DIR`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from router.kv_events import KvEventBatch
from workers.types import EngineLaunchConfig, EngineMetrics, LaunchSpec
from workers.vllm.backend import server_args
from workers.vllm.kv_events import decode_pub_frames

__all__ = ["SIM_TOKENIZER_DIR", "SimBackend", "sim_tokenizer_path"]

SIM_TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"


def sim_tokenizer_path() -> str:
    """Folder holding the sim's tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    return str(SIM_TOKENIZER_DIR)


class SimBackend:
    name = "sim"
    health_path = "/health"
    metrics_path = "/metrics"

    def launch_spec(self, cfg: EngineLaunchConfig) -> LaunchSpec:
        # the sim takes vLLM's own server flags (cfg.model names its profile)
        program = cfg.engine_cmd or [cfg.python or sys.executable, "-m", "workers.sim"]
        argv = [*program, *server_args(cfg), *cfg.extra_args]
        return LaunchSpec(argv=argv, env=dict(cfg.env))

    def parse_metrics(self, text: str) -> EngineMetrics:
        """vLLM's names by default; a sim started with `--flavor sglang|trtllm` serves that engine's
        `/metrics` (sglang:* Prometheus names, TRT-LLM JSON iteration stats), read here as well."""
        from workers.vllm.metrics import parse_vllm_metrics

        if not isinstance(text, str):
            return EngineMetrics()
        if text.lstrip().startswith("["):
            from workers.trtllm.metrics import parse_trtllm_stats

            return parse_trtllm_stats(text)
        if "vllm:" not in text and "sglang:" in text:
            from workers.sglang.metrics import parse_sglang_metrics

            return parse_sglang_metrics(text)
        return parse_vllm_metrics(text)

    def decode_kv_frames(self, frames: list[bytes]) -> KvEventBatch:
        return decode_pub_frames(frames)
