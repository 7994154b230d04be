"""PlannerConfig: one typed tree, built at the entry point (CLI/YAML); nothing below reads env.

Defaults follow Dynamo's planner where it has one: TTFT 500 ms and ITL
50 ms when a pool's targets leave them out, min 1 replica. Ours: tick every 60 s over a 60 s
telemetry window, at most 4 replicas added or removed per pool per tick, no scale-down within 300 s
of the pool's last change and never below the highest count wanted in the last 300 s (Kubernetes
HPA's scale-down stabilization window), telemetry older than 30 s (or absent) holds the pool still; the request
rate is forecast by peak_trend (max of a Kalman trend forecast and the last 2 ticks' peak, where that peak
stood out of its sampling noise) and sized at
forecast × (1 + 1.28·RMS relative one-tick forecast error of the pool's work), at most ×1.5.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PlannerConfig", "LoadThresholds", "PlannerConfigError"]


class PlannerConfigError(ValueError):
    """The planner cannot be built from this configuration (unknown predictor, missing profile...)."""


class LoadThresholds(BaseModel):
    """Load mode (Dynamo's 'easy mode'): up if ANY worker crosses an up-threshold or the observed p90
    is over target; down only if ALL workers are under the down-thresholds and p90 < down_ratio·target."""

    model_config = ConfigDict(extra="forbid")

    queue_up: float = Field(1.0, ge=0)  # waiting requests on one worker
    queue_down: float = Field(0.1, ge=0)
    kv_up: float = Field(0.9, gt=0, le=1)  # KV-cache usage of one worker
    kv_down: float = Field(0.6, ge=0, le=1)
    latency_down_ratio: float = Field(0.8, gt=0, le=1)


class PlannerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["sla", "load", "hybrid"] = "hybrid"  # hybrid: SLA replicas as a floor under load steps
    predictor: Literal["constant", "moving_average", "holt", "kalman", "peak_trend"] = "peak_trend"
    predictor_window: int = Field(6, ge=1)  # moving_average: points averaged
    peak_window: int = Field(2, ge=1)  # peak_trend: ticks whose highest rate is a floor of the forecast
    interval_s: float = Field(60.0, gt=0)  # one tick
    window_s: float | None = Field(None, gt=0)  # telemetry window read per tick (default interval_s)
    lookahead_s: float = Field(0.0, ge=0)  # forecast this far past the next tick (e.g. replica start time)
    stale_after_s: float = Field(30.0, gt=0)
    max_step: int = Field(4, ge=1)
    scale_down_cooldown_s: float = Field(300.0, ge=0)
    scale_down_window_s: float = Field(300.0, ge=0)  # scale down only to the highest count wanted in this window
    advisory: bool = False  # decide and record, never apply
    default_profile: str = "h200-llama3.1-8b"
    profiles: dict[str, str] = Field(default_factory=dict)  # model -> profile name or directory
    max_num_seqs: int = Field(256, ge=1)  # decode batch cap (vLLM default)
    default_ttft_ms: float = Field(500.0, gt=0)
    default_itl_ms: float = Field(50.0, gt=0)
    max_prefill_utilization: float = Field(0.9, gt=0, lt=1)  # prefill sizing never plans busier than this
    demand_z: float = Field(1.28, ge=0)  # size for forecast + z·(forecast error): 1.28 ~ its p90
    # hybrid: does a prefill pool's queue add load corrections? False: only its TTFT p90 over target does —
    # the SLA count plans for queueing up to the TTFT target, so a queue alone is no sign of under-sizing
    hybrid_prefill_queue: bool = False
    # headroom from the forecast error less the window's own sampling noise: off, because the noise is a real error of
    # the rate estimate (it measured worse: more missed minutes at the same GPU-seconds)
    net_of_sampling_noise: bool = False
    max_headroom: float = Field(1.5, ge=1)  # cap on that safety factor
    load: LoadThresholds = Field(default_factory=LoadThresholds)

    @property
    def window(self) -> float:
        return self.window_s or self.interval_s
