"""One typed config tree, built at the entry point (CLI flags, env, YAML); nothing below reads env."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, Field, field_validator

from orchestrator.lora import LoraConfig
from orchestrator.multimodal import MultimodalConfig
from orchestrator.resilience.fairshare import FairShareConfig
from orchestrator.sessions import AffinityConfig
from workers.types import parse_cpu_list

__all__ = ["FrontendConfig", "ClusterConfig", "DisaggConfig", "load_yaml"]


class DisaggConfig(BaseModel):
    """Disaggregated prefill/decode (orchestrator/disagg): applies to a model once it has prefill or decode
    workers; flags --disagg-mode, --enforce-disagg, --disagg-prefill-timeout; YAML `frontend.disagg`.
    The conditional rule and its defaults (Dynamo's) are in orchestrator/disagg/decision.py."""

    mode: str = Field("conditional", pattern="^(conditional|always)$")  # always: every request prefilled remotely
    enforce: bool = False  # Dynamo's enforce_disagg: no aggregated fallback, a failed prefill is a clean 503
    max_local_isl: int = Field(2048, ge=0)  # local when eff_isl < this ...
    max_local_ratio: float = Field(0.7, ge=0, le=1)  # ... and eff_isl / prompt < this (cached on decode)
    max_local_prefill_length: int = Field(0, ge=0)  # local when eff_isl <= this (TRT-LLM/Dynamo v0 rule; 0: off)
    queue_threshold: float = Field(4.0, gt=0)  # local when prefill active tokens > this x max_num_batched_tokens
    max_num_batched_tokens: int = Field(8192, gt=0)  # the prefill engines' token budget per step
    prefill_timeout_s: float = Field(30.0, gt=0)  # longest wait for the prefill hand-off before falling back
    # a decode engine that answers 5xx to a hand-off (vLLM: its KV load failed, e.g. NIXL's 5 s first handshake on a busy
    # host) gets the whole hand-off again, with a fresh prefill, this many times before the aggregated fallback (or 503)
    handoff_retries: int = Field(1, ge=0, le=3)
    decode_overlap_weight: float = Field(0.0, ge=0)  # decode routing: kv cost prefill weight (Dynamo: 0)
    # prefill routing: the kv cost's reuse credit (router/plugins/kv.py); None: the frontend's kv_reuse_weight. The
    # prefill pool is where a recomputed prefix costs compute; 16 is what was measured there (A/B vs 1 in
    # benchmarks/results/routing_disagg.md), kept when the aggregated default moved to 8
    prefill_reuse_weight: float | None = Field(16.0, ge=0)


class FrontendConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = Field(0, ge=0, le=65535)  # KServe v2 gRPC endpoint; 0: off (the CLI defaults it to 8001)
    policy: str = "kv"  # kv | least-loaded | round-robin | random
    # kv cost (router/plugins/kv.py): overlap weight 16, reuse 8, request weight 16, with pending predictions (10 s),
    # chosen side by side on the Mooncake trace at the H200's 59k blocks, 3 rounds (routing_pending_ab.md): hits 96.7%
    # of the fleet bound (rounds 95.3-96.8%) and TTFT p90 777 ms / p50 298 ms, vs 94.1% (93.2-95.5%), 854 / 357 ms at
    # the earlier (8, 16, 0, no predictions); (16, 16, 16) read 95.7%, 804 ms. The older sweeps, at request weight 0
    # and no predictions: routing_overlap_sweep*.md, routing_reuse*.md, routing_pairs_*.md.
    # kv: weight of uncached prefill blocks against decode blocks (Dynamo: 1): how much decode load a cache hit
    # outweighs. High weights alone piled a hot prefix onto its one holder (46 of 64 concurrent requests at 16 with
    # reuse 16; all 12 on one of two real vLLM engines at (16, 8)): the request weight and the pending predictions
    # below are what make 16 safe (test_kv_policy.py, tests/integration/test_kv_routing_vllm.py).
    kv_overlap_weight: float = Field(16.0, ge=0)
    # kv: how many tokens of a worker's pending prefill one prompt token cached there is worth (the credit stops at
    # an empty prefill queue, so it never outweighs decode load). 1 is Dynamo's TTFT-greedy trade, which ignores that
    # a prefix recomputed elsewhere costs the fleet that compute again: at overlap weight 4, reuse 1 vs 16 hit 73% vs
    # 93% of the trace's bound (routing_reuse.md).
    kv_reuse_weight: float = Field(8.0, ge=0)
    # kv: blocks of decode load each request in flight on a worker costs beyond the blocks it holds (a batch slot).
    # 0 is Dynamo's blocks-only load, under which a long cached prefix with short suffixes outweighs many requests.
    kv_request_weight: float = Field(16.0, ge=0)
    # kv: how long a routed request's blocks count as cached on its worker before the engine's events confirm them
    # (router/kv_index.py, pending predictions): a burst on one prefix then replicates it instead of piling onto
    # the one holder the events know of. 0: only what events report.
    kv_pending_ttl_s: float = Field(10.0, ge=0)
    # kv: count a worker's booked prefill as draining at its measured prefill rate (router/load.py, prefill drain)
    # instead of whole until the first token: a worker near the end of a long prompt is then seen as nearly free.
    # Side by side on the trace (59k blocks, 3 rounds, routing_drain_ab.md): TTFT p90 800 vs 857 ms, p50 303 vs
    # 319 ms, hits 97.7% vs 95.0% of the fleet bound (medians; p90 lower in 2 rounds, equal in the third).
    kv_prefill_drain: bool = True
    router_temperature: float = Field(0.0, ge=0)  # kv: 0 = argmin of the cost, > 0 = softmax sampling
    redis_url: str | None = None  # None -> in-memory discovery (embedded default)
    discovery_prefix: str = "kvyard"
    refresh_interval_s: float = Field(1.0, gt=0)  # how often the worker list is re-read
    scrape_interval_s: float = Field(1.0, gt=0)  # how often engine /metrics are scraped
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    first_byte_timeout_s: float = Field(300.0, gt=0)  # time for the engine to answer headers (queueing)
    stream_idle_timeout_s: float = Field(300.0, gt=0)  # longest silence between two chunks of a stream
    max_attempts: int = Field(3, ge=1)  # engines tried for one request before a clean error
    retry_after_s: float = Field(1.0, gt=0)
    # reliability of the request path (orchestrator/resilience/)
    stream_headers_timeout_s: float = Field(30.0, gt=0)  # streams: time for the engine to answer headers (it does before queueing)
    request_timeout_s: float = Field(1800.0, gt=0)  # whole-request deadline, all attempts and migrations included
    max_migrations: int = Field(3, ge=0)  # mid-stream continuations on another worker per request; 0 disables
    retry_backoff_base_s: float = Field(0.05, ge=0)  # retry k waits uniform(0, min(max, base*2^(k-1)))
    retry_backoff_max_s: float = Field(1.0, ge=0)
    breaker_failure_threshold: int = Field(3, ge=1)  # consecutive failures that open a worker's breaker
    breaker_open_s: float = Field(5.0, gt=0)  # first cooldown before a health probe; doubles per failed probe
    breaker_max_open_s: float = Field(60.0, gt=0)
    health_probe_timeout_s: float = Field(2.0, gt=0)  # GET /health of a half-open worker
    max_inflight_per_model: int = Field(0, ge=0)  # admitted requests per model; 0: no limit (saturation still applies)
    max_queued_per_model: int = Field(1024, ge=0)  # admission queue per model; beyond it 503 + Retry-After
    admission_timeout_s: float = Field(30.0, gt=0)  # longest wait in the admission queue, then 503
    saturation_kv_usage: float = Field(0.9, gt=0, le=1)  # a worker is saturated at this KV usage (planner kv_up)...
    saturation_waiting: float = Field(1.0, ge=0)  # ...with at least this many requests waiting (planner queue_up)
    max_tokens_cap: int = Field(0, ge=0)  # largest max_tokens accepted (400 above); 0: only the context length bounds it
    log_requests: bool = False
    # a frontend event loop that turns this late is a stall: counted, logged with the stack that held it
    # (orchestrator/loopwatch.py); 0: no watch
    loop_stall_s: float = Field(1.0, ge=0)
    admin_token: str | None = Field(None, repr=False)  # bearer token of /admin, /dashboard and /api/*; None disables them
    # None: on when there is no admin token and the frontend listens on loopback only (orchestrator/security/guards.py)
    admin_loopback_reads: bool | None = None
    api_keys_file: Path | None = None  # inference API keys (orchestrator/security/keys.py); None: no key needed
    rate_limit_store: str = Field("auto", pattern="^(auto|local|redis)$")  # per-key buckets; auto: redis when redis_url is set
    tls_cert_file: Path | None = None  # PEM certificate (chain) for HTTPS and gRPC over TLS; with tls_key_file
    tls_key_file: Path | None = None
    telemetry: bool = True  # per-pool telemetry for the planner (Redis when redis_url is set, else in memory)
    telemetry_interval_s: float = Field(1.0, gt=0)
    disagg: DisaggConfig = Field(default_factory=DisaggConfig)
    # ---- peers' most asked-for features (docs/features.md); one sub-model each, defined next to its code ----
    lora: LoraConfig = Field(default_factory=LoraConfig)  # LoRA adapters served on demand (orchestrator/lora.py)
    affinity: AffinityConfig = Field(default_factory=AffinityConfig)  # session affinity (orchestrator/sessions.py)
    multimodal: MultimodalConfig = Field(default_factory=MultimodalConfig)  # image/audio parts (orchestrator/multimodal.py)
    fair_share: FairShareConfig = Field(default_factory=FairShareConfig)  # admission order (resilience/fairshare.py)


class ClusterConfig(BaseModel):
    """`kvyard up`: a local cluster of engines behind one frontend."""

    frontend: FrontendConfig = Field(default_factory=FrontendConfig)
    backend: str = "sim"
    workers: int = Field(2, ge=1, le=128)  # aggregated workers (role both); unused when prefill/decode workers are set
    prefill_workers: int = Field(0, ge=0, le=128)  # > 0 with decode_workers: a disaggregated cluster
    decode_workers: int = Field(0, ge=0, le=128)
    flavor: str = Field("vllm", pattern="^(vllm|sglang|trtllm)$")  # P/D hand-off protocol (sim: --flavor)
    model: str = "h200-llama3.1-8b"  # sim: profile name; vllm: model directory
    served_model_name: str = "kvyard-sim"
    base_port: int = 8100
    block_size: int = 16
    max_model_len: int = 8192
    speedup: float = Field(1.0, gt=0)
    engine_args: list[str] = Field(default_factory=list)
    engine_start_timeout_s: float = Field(600.0, gt=0)  # an engine not healthy by then fails `kvyard up`
    # CPUs every engine runs on, given as a Linux CPU list ("1", "2-7"); None: any CPU. Keeps cores free for the frontend
    # on CPU hosts (workers/types.py EngineLaunchConfig.cpus says why NIXL P/D engines need it).
    engine_cpus: frozenset[int] | None = None
    log_dir: Path = Path(".kvyard/logs")

    @field_validator("engine_cpus", mode="before")
    @classmethod
    def _cpu_list(cls, v):
        return parse_cpu_list(v) if isinstance(v, str) else v  # ValueError -> a validation error naming the field


def load_yaml(path: str | Path) -> dict:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data
