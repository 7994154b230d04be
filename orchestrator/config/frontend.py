"""The frontend's settings: one nested, typed tree; each field's default is here and nowhere else.

    frontend:
      host, port, grpc_port, redis_url, ...   the server and where it finds workers
      router:      policy and each policy's parameters (router/config.py)
      resilience:  timeouts, retries, migration, circuit breakers (orchestrator/resilience)
      admission:   per-model queue and fleet saturation (orchestrator/resilience/admission.py)
      security:    admin token, API keys, rate-limit store, TLS (orchestrator/security)
      telemetry:   per-pool telemetry for the planner; request tracing (OpenTelemetry, telemetry.tracing)
      disagg:      disaggregated prefill/decode (orchestrator/disagg)
      lora, affinity, multimodal, fair_share:  LoRA adapters, session affinity, image/audio parts, admission order
                   (docs/features.md; each model lives next to its code)

Every model forbids unknown keys, so a typo in a YAML file is an error that names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.lora import LoraConfig
from orchestrator.multimodal import MultimodalConfig
from orchestrator.resilience.fairshare import FairShareConfig
from orchestrator.sessions import AffinityConfig
from orchestrator.request_fields import RequestFieldsConfig
from orchestrator.tracing import TracingConfig
from router.config import RouterConfig

__all__ = ["FrontendConfig", "FrontendFile", "ResilienceConfig", "AdmissionConfig", "SecurityConfig", "TelemetryConfig", "DisaggConfig"]

_STRICT = ConfigDict(extra="forbid")


class ResilienceConfig(BaseModel):
    """Deadlines, retries, migration and circuit breakers of the request path."""

    model_config = _STRICT

    connect_timeout_s: float = Field(5.0, gt=0, description="time to open a connection to an engine")
    first_byte_timeout_s: float = Field(300.0, gt=0, description="unary requests: time for the engine's answer to start "
                                                                 "(it may be queueing)")
    stream_headers_timeout_s: float = Field(30.0, gt=0, description="streams: time for the engine to answer headers "
                                                                    "(engines answer them before queueing)")
    stream_idle_timeout_s: float = Field(300.0, gt=0, description="longest silence between two chunks of a stream")
    request_timeout_s: float = Field(1800.0, gt=0, description="whole-request deadline, all attempts and migrations included")
    max_attempts: int = Field(3, ge=1, description="engines tried for one request before a clean error")
    max_migrations: int = Field(3, ge=0, description="mid-stream continuations on another worker per request (0: off)")
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After sent with a 503")
    retry_backoff_base_s: float = Field(0.05, ge=0, description="retry k waits uniform(0, min(max, base·2^(k-1)))")
    retry_backoff_max_s: float = Field(1.0, ge=0, description="cap of that wait")
    breaker_failure_threshold: int = Field(3, ge=1, description="consecutive failures that open a worker's breaker")
    breaker_open_s: float = Field(5.0, gt=0, description="first cooldown before a health probe; doubles per failed probe")
    breaker_max_open_s: float = Field(60.0, gt=0, description="longest cooldown")
    health_probe_timeout_s: float = Field(2.0, gt=0, description="time for a half-open worker to answer GET /health")


class AdmissionConfig(BaseModel):
    """Per-model admission: a bounded queue in front of a saturated fleet."""

    model_config = _STRICT

    max_inflight_per_model: int = Field(0, ge=0, description="admitted requests per model (0: no limit)")
    max_queued_per_model: int = Field(1024, ge=0, description="requests waiting for admission per model; beyond it 503")
    timeout_s: float = Field(30.0, gt=0, description="longest wait in the admission queue, then 503")
    saturation_kv_usage: float = Field(0.9, gt=0, le=1, description="a worker is saturated at this KV-cache usage...")
    saturation_waiting: float = Field(1.0, ge=0, description="...with at least this many requests waiting on it")


class SecurityConfig(BaseModel):
    """Who may call what: admin token, inference API keys, rate-limit buckets, TLS (docs/operations.md)."""

    model_config = _STRICT

    admin_token: str | None = Field(None, repr=False, description="bearer token of /admin, /dashboard and /api/* "
                                                                  "(env KVYARD_ADMIN_TOKEN); none: admin writes refused")
    admin_loopback_reads: bool | None = Field(None, description="admin reads from this machine without a token; "
                                                                "none: on when there is no token and the host is loopback")
    api_keys_file: Path | None = Field(None, description="inference API key file (`kvyard keys`); none: no key needed")
    rate_limit_store: Literal["auto", "local", "redis"] = Field("auto", description="per-key buckets; auto: Redis when "
                                                                                    "redis_url is set")
    tls_cert_file: Path | None = Field(None, description="PEM certificate (chain): HTTPS and gRPC over TLS")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file")
    registry_secret: str | None = Field(None, repr=False, min_length=16, description="shared secret the registry's "
                                        "entries must be signed with (env KVYARD_REGISTRY_SECRET; docs/security.md); "
                                        "none: unsigned entries accepted")
    allowed_hosts: list[str] | None = Field(None, description="Host names answered on state-changing and admin routes "
                                            "(DNS rebinding); none: localhost names when bound to loopback, else any; "
                                            "[\"*\"]: any")
    allowed_origins: list[str] = Field(default_factory=list, description="browser origins allowed besides the "
                                       "frontend's own (e.g. a separate UI)")
    request_fields: RequestFieldsConfig = Field(default_factory=RequestFieldsConfig, description="what of a client's "
                                                "request reaches the engine (orchestrator/request_fields.py)")


class TelemetryConfig(BaseModel):
    """Per-pool telemetry the planner reads (Redis when redis_url is set, else in memory), and request tracing."""

    model_config = _STRICT

    enabled: bool = Field(True, description="record per-pool telemetry")
    interval_s: float = Field(1.0, gt=0, description="flush interval")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry request traces over OTLP "
                                                                            "(orchestrator/tracing.py)")


class DisaggConfig(BaseModel):
    """Disaggregated prefill/decode; applies to a model once it has prefill or decode workers. The conditional rule
    (Dynamo's) is in orchestrator/disagg/decision.py."""

    model_config = _STRICT

    mode: Literal["conditional", "always"] = Field("conditional", description="always: every request prefilled remotely")
    enforce: bool = Field(False, description="no aggregated fallback: a failed prefill is a clean 503")
    max_local_isl: int = Field(2048, ge=0, description="prefill locally when fewer uncached prompt tokens than this...")
    max_local_ratio: float = Field(0.7, ge=0, le=1, description="...and they are under this share of the prompt")
    max_local_prefill_length: int = Field(0, ge=0, description="prefill locally when uncached tokens <= this "
                                                               "(TRT-LLM's rule; 0: off)")
    queue_threshold: float = Field(4.0, gt=0, description="prefill locally when the prefill pool has more than this × "
                                                          "max_num_batched_tokens in flight")
    max_num_batched_tokens: int = Field(8192, gt=0, description="the prefill engines' token budget per step")
    prefill_timeout_s: float = Field(30.0, gt=0, description="longest wait for the prefill hand-off before falling back")
    handoff_retries: int = Field(1, ge=0, le=3, description="whole hand-offs retried when a decode engine answers 5xx")
    decode_overlap_weight: float = Field(0.0, ge=0, description="decode routing: the kv cost's prefill weight "
                                                                "(Dynamo: 0)")
    prefill_reuse_weight: float | None = Field(16.0, ge=0, description="prefill routing: the kv cost's reuse weight "
                                                                       "(none: router.kv.reuse_weight)")


class FrontendConfig(BaseModel):
    """`kvyard frontend` (and the frontend of `kvyard up`)."""

    model_config = _STRICT

    host: str = Field("127.0.0.1", description="address the HTTP (and gRPC) server binds")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    grpc_port: int = Field(8001, ge=0, le=65535, description="KServe v2 gRPC port (0: off)")
    redis_url: str | None = Field(None, repr=False, description="Redis for discovery, telemetry, targets, shared "
                                  "rate limits (none: in memory, one process); redis://[user:password@]host:port/db or "
                                  "rediss://...?ssl_ca_certs=PATH")
    discovery_prefix: str = Field("kvyard", min_length=1, description="Redis key prefix, one per cluster")
    refresh_interval_s: float = Field(1.0, gt=0, description="how often the worker list is re-read")
    scrape_interval_s: float = Field(1.0, gt=0, description="how often engines' /metrics are scraped")
    scrape_timeout_s: float = Field(2.0, gt=0, description="longest wait for one scrape")
    liveness_failures: int = Field(2, ge=0, description="failed scrapes in a row (confirmed by a failed health check) "
                                   "that take an engine out of routing and fail over its requests (0: off)")
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="largest request body (413 above)")
    header_timeout_s: float = Field(15.0, gt=0, description="longest a request's headers may take (408 and closed)")
    body_timeout_s: float = Field(30.0, gt=0, description="longest silence inside a request body (408 and closed)")
    max_connections: int = Field(4096, ge=1, description="open client connections; more are closed as they arrive")
    max_tokens_cap: int = Field(0, ge=0, description="largest max_tokens accepted (400 above; 0: the context bounds it)")
    prompt_cache_tokens: int = Field(2_000_000, ge=0, description="token ids of long prompts' chunks kept per tokenizer, "
                                     "so a conversation's history is tokenized once (about 8 bytes each with their text; 0: off; "
                                     "orchestrator/token_cache.py)")
    fast_bpe: bool = Field(True, description="tokenize prompts with tiktoken's BPE core where it gives the tokenizer's "
                           "own ids (checked when the tokenizer loads; about a fifth of the CPU; orchestrator/fast_bpe.py)")
    learn_prompt_ids: bool = Field(True, description="cache the ids of long prompts' untokenized chunks from the ids the "
                                   "engine sends back (vLLM's return_token_ids), checked against the text byte for byte, "
                                   "so text seen again is not tokenized (orchestrator/token_cache.py)")
    gc_freeze: bool = Field(True, description="keep the permanent heap (imports, the app, tokenizers) out of the garbage "
                            "collector's full collections, which otherwise stop the event loop for tens of ms "
                            "(`kvyard frontend` and `kvyard up`; orchestrator/heap.py)")
    log_requests: bool = Field(False, description="access log: one line per inference request on the kvyard.access logger "
                                                  "(status, worker, tokens, queue/TTFT/total time; orchestrator/access_log.py)")
    log_requests_format: Literal["text", "json"] = Field("text", description="access log lines as key=value text or JSON")
    loop_stall_s: float = Field(1.0, ge=0, description="an event loop this late is a stall: counted and logged with "
                                                       "its stack (0: no watch)")
    router: RouterConfig = Field(default_factory=RouterConfig, description="routing policy and its parameters")
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig, description="timeouts, retries, migration, "
                                                                                       "breakers")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="per-model admission queue")
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="admin token, API keys, TLS")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="telemetry for the planner")
    disagg: DisaggConfig = Field(default_factory=DisaggConfig, description="disaggregated prefill/decode")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters loaded on demand (orchestrator/lora.py)")
    affinity: AffinityConfig = Field(default_factory=AffinityConfig, description="session affinity (orchestrator/sessions.py)")
    multimodal: MultimodalConfig = Field(default_factory=MultimodalConfig, description="image and audio parts of chat "
                                                                                       "messages (orchestrator/multimodal.py)")
    fair_share: FairShareConfig = Field(default_factory=FairShareConfig, description="admission order: priority classes, "
                                                                                    "fair share across keys")


class FrontendFile(BaseModel):
    """`kvyard frontend`: its `--config` file holds the frontend's settings under `frontend:` (as the Helm chart writes)."""

    model_config = _STRICT

    frontend: FrontendConfig = Field(default_factory=FrontendConfig, description="the frontend's settings")
