"""ReplayConfig: one typed tree for a replay, built at the entry point (`kvyard replay` flags and YAML).

    engine      the sim engine of every worker (profile, block size, KV blocks, batch limits, prefill pricing);
                `profile` may also be a mocker-format NPZ (Dynamo's converted perf data: workers/sim/mocker_timing.py)
    frontend    the frontend's own config (orchestrator/config.py FrontendConfig): the routing policy and its
                kv weights, P/D decision, scrape and telemetry intervals; the replay routes with exactly these
    workers     aggregated workers, or prefill + decode for P/D pools
    event_lag_ms  how long a step's KV events take to reach the router's index (0: at the step's end)
    startup_s   a worker the planner adds serves this long after the request (billed from the request)
    transfer    P/D KV transfer: latency + tokens × bytes per token / bandwidth (workers/sim/disagg.py)
    slo_*       per-minute TTFT p90 and ITL p90 targets for "minutes within SLA" (None: not judged)
    planner     a `kvyard planner` YAML document ({planner: PlannerConfig, targets: Targets}); None: fixed fleet
Defaults: the bundled H200 Llama-3.1-8B-FP8 profile, 64-token blocks (Dynamo's mocker default; 4x fewer block
operations than serving's 16 for the same timing), the profile's KV capacity, vLLM's batch limits,
131,072-token context (the Mooncake trace's longest prompt is 126,195).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.config import FrontendConfig
from workers.sim.profiles import DEFAULT_PROFILE

__all__ = ["EngineSpec", "ReplayConfig", "TransferSpec"]


class EngineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    profile: str = DEFAULT_PROFILE
    block_size: int = Field(64, ge=1)
    num_gpu_blocks: int | None = Field(None, ge=2)  # None: the profile's max_kv_tokens // block_size
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    max_model_len: int = Field(131072, ge=2)
    prefill_pricing: Literal["profile", "new-tokens"] = "profile"
    enable_prefix_caching: bool = True
    gpus_per_replica: int = Field(1, ge=1)


class TransferSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bandwidth_gbps: float = Field(25.0, gt=0)
    latency_ms: float = Field(1.0, ge=0)
    bytes_per_token: int | None = Field(None, gt=0)  # None: from the profile's model geometry


class ReplayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineSpec = Field(default_factory=EngineSpec)
    frontend: FrontendConfig = Field(default_factory=FrontendConfig)
    model: str = "kvyard-sim"
    workers: int = Field(8, ge=0)
    prefill: int = Field(0, ge=0)
    decode: int = Field(0, ge=0)
    event_lag_ms: float = Field(0.0, ge=0)
    startup_s: float = Field(60.0, ge=0)
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    slo_ttft_p90_ms: float | None = Field(None, gt=0)
    slo_itl_p90_ms: float | None = Field(None, gt=0)
    planner: dict | None = None
    seed: int = 0

    @model_validator(mode="after")
    def _pools(self) -> ReplayConfig:
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError("P/D pools need both prefill and decode workers (> 0 each)")
        if not self.disaggregated and self.workers < 1 and self.planner is None:
            raise ValueError("workers must be >= 1 (or give prefill and decode)")
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 and self.decode > 0
