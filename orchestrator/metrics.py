"""The frontend's Prometheus metrics (one private registry per app, served on /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["FrontendMetrics"]

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
_TOK = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvyard_requests", "Requests by model, route and status", ["model", "endpoint", "status"], registry=r)
        self.inflight = Gauge("kvyard_inflight_requests", "Requests in flight", ["model"], registry=r)
        self.ttft = Histogram("kvyard_time_to_first_token_seconds", "Time to first token", ["model"], buckets=_LAT, registry=r)
        self.itl = Histogram("kvyard_inter_token_latency_seconds", "Time between streamed chunks", ["model"], buckets=_ITL, registry=r)
        self.duration = Histogram("kvyard_request_duration_seconds", "Whole request", ["model"], buckets=_LAT, registry=r)
        self.isl = Histogram("kvyard_input_sequence_tokens", "Prompt tokens", ["model"], buckets=_TOK, registry=r)
        self.osl = Histogram("kvyard_output_sequence_tokens", "Generated tokens", ["model"], buckets=_TOK, registry=r)
        self.routed = Counter("kvyard_router_decisions", "Routing decisions by chosen worker", ["model", "worker", "policy"], registry=r)
        self.decision_time = Histogram(
            "kvyard_router_decision_seconds", "Time to take one routing decision", buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2), registry=r
        )
        self.kv_hit_rate = Histogram("kvyard_router_kv_hit_rate", "Share of the prompt cached on the chosen worker (predicted)",
                                     ["model"], buckets=(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0), registry=r)
        self.overlap_blocks = Counter("kvyard_router_overlap_blocks", "Prompt blocks found cached on the chosen worker", ["model"], registry=r)
        self.prompt_blocks = Counter("kvyard_router_prompt_blocks", "Full prompt blocks routed", ["model"], registry=r)
        self.retries = Counter("kvyard_engine_retries", "Requests re-sent to another engine before streaming", ["model"], registry=r)
        self.workers = Gauge("kvyard_workers", "Live workers by model and state", ["model", "state"], registry=r)
