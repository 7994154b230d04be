"""One typed config tree, built at the entry point (CLI flags, env, YAML); nothing below reads env."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, Field

__all__ = ["FrontendConfig", "ClusterConfig", "load_yaml"]


class FrontendConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = Field(0, ge=0, le=65535)  # KServe v2 gRPC endpoint; 0: off (the CLI defaults it to 8001)
    policy: str = "kv"  # kv | least-loaded | round-robin | random
    kv_overlap_weight: float = Field(1.0, ge=0)  # kv: weight of uncached prefill blocks against decode blocks
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
    log_requests: bool = False
    admin_token: str | None = Field(None, repr=False)  # bearer token of /admin and the dashboard's writes; None disables them
    telemetry: bool = True  # per-pool telemetry for the planner (Redis when redis_url is set, else in memory)
    telemetry_interval_s: float = Field(1.0, gt=0)


class ClusterConfig(BaseModel):
    """`kvyard up`: a local cluster of engines behind one frontend."""

    frontend: FrontendConfig = Field(default_factory=FrontendConfig)
    backend: str = "sim"
    workers: int = Field(2, ge=1, le=128)
    model: str = "h200-llama3.1-8b"  # sim: profile name; vllm: model directory
    served_model_name: str = "kvyard-sim"
    base_port: int = 8100
    block_size: int = 16
    max_model_len: int = 8192
    speedup: float = Field(1.0, gt=0)
    engine_args: list[str] = Field(default_factory=list)
    log_dir: Path = Path(".kvyard/logs")


def load_yaml(path: str | Path) -> dict:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data
