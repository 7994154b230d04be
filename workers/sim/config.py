"""Sim engine configuration: vLLM's own server flags plus the sim's, parsed once at the CLI.

vLLM flags (same names and defaults as vLLM 0.32 where they matter here):
  --host 127.0.0.1 (vLLM: all interfaces)   --port 8000   --served-model-name NAME [NAME ...]
  --model (profile name or directory when --profile is not given; else only reported as `root`)
  --block-size 16   --max-model-len 8192   --max-num-seqs 256   --max-num-batched-tokens 8192
  --kv-events-config '<json KVEventsConfig>'   --enable-prompt-tokens-details
  --no-enable-prefix-caching / --enable-prefix-caching
Sim flags:
  --profile h200-llama3.1-8b | h100-llama3.3-70b-tp2|tp4|tp8 | <dir with prefill.npz, decode.npz>
  --speedup 1.0 (all step times divided by it)   --num-gpu-blocks (default max_kv_tokens // block_size)
  --prefill-pricing profile (a chunk costs T(cached + new) - T(cached)) | new-tokens (T(new): Dynamo's mocker)
  --seed 0 (output text)   --hash-seed (NONE_HASH seed; the CLI passes PYTHONHASHSEED like vLLM does)
  --uvicorn-loop auto|asyncio|uvloop   --uvicorn-http auto|h11|httptools (auto: the fastest installed)
LoRA (workers/sim/adapters.py): --enable-lora, --lora-modules name=path ..., --max-loras (accepted; the sim batches
  any number); runtime loading with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, read from the environment like vLLM
Multimodal chat parts (workers/multimodal.py): --mm-image-tokens 256 --mm-image-token-id 100255
  --mm-audio-tokens 128 --mm-audio-token-id 100254 (placeholder tokens one image / audio clip stands for)
Unknown vLLM flags are accepted and ignored, so a vLLM command line runs unchanged.

The other engines' own spellings are accepted too, so the command line kvyard builds for SGLang or
TensorRT-LLM (workers/sglang/backend.py, workers/trtllm/backend.py) runs the sim unchanged behind
`--engine-cmd "python -m workers.sim --flavor sglang|trtllm"`:
  SGLang:  --model-path, --page-size, --context-length, --max-running-requests, --chunked-prefill-size
  TRT-LLM: MODEL (positional), --max_seq_len, --max_batch_size, --max_num_tokens,
           --extra_llm_api_options/--config FILE (YAML: kv_cache_config.tokens_per_block -> block size,
           kv_cache_config.enable_block_reuse -> prefix caching)

P/D disaggregation (workers/sim/disagg.py), each engine's own switches:
  --flavor vllm|sglang|trtllm (default vllm; which engine's hand-off protocol the sim speaks)
  vllm:   --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}' (+ kv_load_failure_policy,
          engine_id, kv_connector_extra_config.kv_lease_duration); side channel on VLLM_NIXL_SIDE_CHANNEL_HOST
          (default localhost) : VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600), read from the environment like vLLM
  sglang: --disaggregation-mode null|prefill|decode   --disaggregation-bootstrap-port 8998 (prefill side)
  trtllm: the role comes from each request's disaggregated_params.request_type
  all:    --kv-transfer-bandwidth-gbps 25 (GB/s)   --kv-transfer-latency-ms 1.0   --kv-bytes-per-token (default:
          from the profile's model, see disagg.default_kv_bytes_per_token)   --kv-transfer-timeout 300 (s; SGLang:
          how long a decode waits for its room and a prefill holds unread KV; TRT-LLM: how long unread KV is held)
          --kv-side-channel-port (overrides the flavor's side-channel port; 0 = ephemeral; TRT-LLM default 0)
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from dataclasses import dataclass, field
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict

from workers.multimodal import MmTokenSpec
from workers.sim.disagg import FLAVORS, KvTransferConfig
from workers.sim.hashing import DEFAULT_SEED
from workers.sim.profiles import BUNDLED, DEFAULT_PROFILE
from workers.sim.timing import TimingModel

__all__ = ["KvEventsConfig", "SimConfig", "build_parser", "parse_args"]

_MM = MmTokenSpec()  # the placeholder defaults, shared with the frontend's MultimodalConfig


class KvEventsConfig(BaseModel):
    """vLLM's `KVEventsConfig` (vllm/config/kv_events.py), same fields, defaults and order."""

    model_config = ConfigDict(extra="ignore")

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""

    def model_post_init(self, _ctx: object) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


@dataclass
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=lambda: [DEFAULT_PROFILE])
    model: str = DEFAULT_PROFILE
    profile: str = DEFAULT_PROFILE
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_gpu_blocks: int | None = None
    speedup: float = 1.0
    prefill_pricing: str = "profile"  # or "new-tokens" (Dynamo's mocker; workers/sim/timing.py)
    seed: int = 0
    hash_seed: str = DEFAULT_SEED
    enable_prefix_caching: bool = True
    enable_prompt_tokens_details: bool = False
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    log_level: str = "warning"
    uvicorn_loop: str = "auto"  # auto picks uvloop when installed
    uvicorn_http: str = "auto"  # auto picks httptools when installed
    flavor: str = "vllm"
    kv_transfer: KvTransferConfig | None = None
    disaggregation_mode: str = "null"
    bootstrap_port: int = 8998
    side_channel_host: str = "localhost"
    side_channel_port: int = 5600
    kv_transfer_bandwidth_gbps: float = 25.0
    kv_transfer_latency_ms: float = 1.0
    kv_bytes_per_token: int | None = None
    kv_transfer_timeout: float = 300.0
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)
    runtime_lora_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    mm: MmTokenSpec = field(default_factory=MmTokenSpec)
    runner: str = "generate"  # vLLM's --runner: "pooling" serves /v1/embeddings (workers/sim/responses_api.py)

    @property
    def disagg_enabled(self) -> bool:
        if self.flavor == "vllm":
            return self.kv_transfer is not None and self.kv_transfer.is_nixl
        if self.flavor == "sglang":
            return self.disaggregation_mode != "null"
        return self.flavor == "trtllm"

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.sim", description="kvyard simulated vLLM engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", "--model-path", dest="model", default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--block-size", "--page-size", dest="block_size", type=int, default=None)
    p.add_argument("--max-model-len", "--context-length", "--max_seq_len", dest="max_model_len", type=int, default=8192)
    p.add_argument("--max-num-seqs", "--max-running-requests", "--max_batch_size", dest="max_num_seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", "--chunked-prefill-size", "--max_num_tokens", dest="max_num_batched_tokens",
                   type=int, default=8192)
    p.add_argument("--extra_llm_api_options", "--config", dest="extra_llm_api_options", default=None)
    p.add_argument("--kv-events-config", default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--profile", default=None)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--prefill-pricing", choices=TimingModel.PRICINGS, default="profile",
                   help="profile: a chunk costs T(cached + new) - T(cached); new-tokens: T(new) (Dynamo's mocker)")
    p.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hash-seed", default=None)
    p.add_argument("--uvicorn-log-level", "--log-level", dest="log_level", default="warning")
    p.add_argument("--uvicorn-loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    p.add_argument("--uvicorn-http", choices=["auto", "h11", "httptools"], default="auto")
    p.add_argument("--flavor", choices=FLAVORS, default="vllm")
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto")
    p.add_argument("--kv-transfer-config", default=None)
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--kv-transfer-bandwidth-gbps", type=float, default=25.0)
    p.add_argument("--kv-transfer-latency-ms", type=float, default=1.0)
    p.add_argument("--kv-bytes-per-token", type=int, default=None)
    p.add_argument("--kv-transfer-timeout", type=float, default=300.0)
    p.add_argument("--kv-side-channel-port", type=int, default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--mm-image-tokens", type=int, default=_MM.tokens_per_image)
    p.add_argument("--mm-image-token-id", type=int, default=_MM.image_token_id)
    p.add_argument("--mm-audio-tokens", type=int, default=_MM.tokens_per_audio)
    p.add_argument("--mm-audio-token-id", type=int, default=_MM.audio_token_id)
    return p


def parse_args(argv: Sequence[str] | None = None, hash_seed: str | None = None, env: Mapping[str, str] | None = None) -> SimConfig:
    """CLI -> SimConfig. `hash_seed` is what the entry point read from PYTHONHASHSEED (or None); `env`
    supplies VLLM_NIXL_SIDE_CHANNEL_HOST/PORT (the entry point passes os.environ)."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    env = env or {}
    if ns.model is None and unknown and not unknown[0].startswith("-"):
        ns.model = unknown[0]  # `vllm serve MODEL` style positional
    if ns.speedup <= 0:
        parser.error("--speedup must be > 0")
    if ns.kv_transfer_bandwidth_gbps <= 0 or ns.kv_transfer_latency_ms < 0 or ns.kv_transfer_timeout <= 0:
        parser.error("--kv-transfer-bandwidth-gbps and --kv-transfer-timeout must be > 0, --kv-transfer-latency-ms >= 0")
    if ns.kv_bytes_per_token is not None and ns.kv_bytes_per_token <= 0:
        parser.error("--kv-bytes-per-token must be > 0")
    if min(ns.mm_image_tokens, ns.mm_audio_tokens, ns.mm_image_token_id, ns.mm_audio_token_id) < 0:
        parser.error("--mm-* values must be >= 0")
    modules = {}
    for item in ns.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--lora-modules takes name=path, got {item!r}")
        modules[name] = path
    try:
        kv_transfer = KvTransferConfig.model_validate_json(ns.kv_transfer_config) if ns.kv_transfer_config else None
    except ValueError as exc:
        parser.error(f"--kv-transfer-config: {exc}")
    # vLLM: its env var; SGLang/TRT-LLM: the sim's own --host (the side channel listens where HTTP does)
    side_host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost") if ns.flavor == "vllm" else ns.host
    if ns.kv_side_channel_port is not None:
        side_port = ns.kv_side_channel_port
    elif ns.flavor == "vllm":
        side_port = int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
    elif ns.flavor == "sglang":
        side_port = ns.disaggregation_bootstrap_port
    else:
        side_port = 0
    if ns.profile:
        profile = ns.profile
    elif ns.model and (ns.model in BUNDLED or (Path(ns.model) / "prefill.npz").is_file()):
        profile = ns.model
    else:  # no model, or a model that is not a profile (kept as `root`): the default profile times it
        profile = DEFAULT_PROFILE
    model = ns.model or profile
    block_size, prefix_caching = ns.block_size, ns.enable_prefix_caching
    if ns.extra_llm_api_options:  # TRT-LLM's LLM API options YAML: the KV cache settings the sim can honour
        try:
            opts = yaml.safe_load(Path(ns.extra_llm_api_options).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            parser.error(f"--extra_llm_api_options: {exc}")
        kvc = opts.get("kv_cache_config") if isinstance(opts, dict) else None
        if isinstance(kvc, dict):
            block_size = block_size or kvc.get("tokens_per_block")
            prefix_caching = prefix_caching and kvc.get("enable_block_reuse", True) is not False
    kv = KvEventsConfig.model_validate_json(ns.kv_events_config) if ns.kv_events_config else KvEventsConfig()
    if ns.flavor == "sglang" and kv.publisher == "zmq":  # SGLang's config has no enable flag: a zmq publisher is on
        kv.enable_kv_cache_events = True
    return SimConfig(
        host=ns.host,
        port=ns.port,
        served_model_names=list(ns.served_model_name or [model]),
        model=model,
        profile=profile,
        block_size=int(block_size or 16),
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        num_gpu_blocks=ns.num_gpu_blocks,
        speedup=ns.speedup,
        prefill_pricing=ns.prefill_pricing,
        seed=ns.seed,
        hash_seed=ns.hash_seed or hash_seed or DEFAULT_SEED,
        enable_prefix_caching=prefix_caching,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        kv_events=kv,
        log_level=ns.log_level,
        uvicorn_loop=ns.uvicorn_loop,
        uvicorn_http=ns.uvicorn_http,
        flavor=ns.flavor,
        kv_transfer=kv_transfer,
        disaggregation_mode=ns.disaggregation_mode,
        bootstrap_port=ns.disaggregation_bootstrap_port,
        side_channel_host=side_host,
        side_channel_port=side_port,
        kv_transfer_bandwidth_gbps=ns.kv_transfer_bandwidth_gbps,
        kv_transfer_latency_ms=ns.kv_transfer_latency_ms,
        kv_bytes_per_token=ns.kv_bytes_per_token,
        kv_transfer_timeout=ns.kv_transfer_timeout,
        enable_lora=ns.enable_lora,
        lora_modules=modules,
        runtime_lora_updating=env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true"),
        mm=MmTokenSpec(ns.mm_image_tokens, ns.mm_image_token_id, ns.mm_audio_tokens, ns.mm_audio_token_id),
        runner="pooling" if ns.runner == "pooling" else "generate",
    )
