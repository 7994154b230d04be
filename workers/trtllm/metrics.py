"""TensorRT-LLM's metrics, read into kvyard's EngineMetrics.

trtllm-serve has two endpoints (`serve/openai_server.py`):
- `GET /prometheus/metrics`, served when the LLM API option `return_perf_metrics` is on (kvyard's
  YAML turns it on): Prometheus text, prefix `trtllm_` (`tensorrt_llm/metrics/collector.py`), label
  `model_name`: gauges `trtllm_num_requests_running`, `trtllm_num_requests_waiting`,
  `trtllm_kv_cache_utilization` (0..1), `trtllm_kv_cache_hit_rate`. Not drained by a read, so any
  number of frontends can scrape it: this is what kvyard scrapes (`TrtllmBackend.metrics_path`).
- `GET /metrics`: JSON iteration stats, *drained* per call (one object per engine step; needs
  `enable_iter_perf_stats`): `numActiveRequests`, `numQueuedRequests`, `kvCacheStats` {maxNumBlocks,
  usedNumBlocks, ...}. The key names follow TRT-LLM's IterationStats JSON as read in its source, not
  checked against a running engine.
`parse_trtllm_metrics` takes either (JSON when the body starts with `[`). Neither carries cumulative
token counters kvyard can diff, so those stay 0. Never raises.
"""

from __future__ import annotations

import json
import math

from workers.prom_text import samples_by_name
from workers.types import EngineMetrics

__all__ = ["TRTLLM_PROMETHEUS_FIELDS", "parse_trtllm_metrics", "parse_trtllm_prometheus", "parse_trtllm_stats"]

TRTLLM_PROMETHEUS_FIELDS: dict[str, str] = {
    "num_requests_running": "trtllm_num_requests_running",
    "num_requests_waiting": "trtllm_num_requests_waiting",
    "kv_cache_usage": "trtllm_kv_cache_utilization",
}


def parse_trtllm_prometheus(text: str) -> EngineMetrics:
    """`/prometheus/metrics` text -> EngineMetrics (gauges summed over label sets; utilisation averaged)."""
    values = samples_by_name(text, "trtllm_")
    out = EngineMetrics()
    for fld, name in TRTLLM_PROMETHEUS_FIELDS.items():
        got = values.get(name)
        if got:
            setattr(out, fld, sum(got) / len(got) if fld == "kv_cache_usage" else sum(got))
    return out


def parse_trtllm_stats(text: str) -> EngineMetrics:
    """JSON iteration stats -> EngineMetrics from the newest iteration (no iteration since the last read
    reads as idle)."""
    out = EngineMetrics()
    try:
        stats = json.loads(text)
    except ValueError:
        return out
    if not isinstance(stats, list) or not stats or not isinstance(stats[-1], dict):
        return out
    last = stats[-1]
    kv = last.get("kvCacheStats") if isinstance(last.get("kvCacheStats"), dict) else {}
    try:
        out.num_requests_running = float(last.get("numActiveRequests") or 0)
        out.num_requests_waiting = float(last.get("numQueuedRequests") or 0)
        total = float(kv.get("maxNumBlocks") or 0)
        out.kv_cache_usage = float(kv.get("usedNumBlocks") or 0) / total if total > 0 else 0.0
    except (TypeError, ValueError):
        return EngineMetrics()
    return out


def parse_trtllm_metrics(text: str) -> EngineMetrics:
    """Either endpoint's body -> EngineMetrics. Never raises."""
    if not isinstance(text, str):
        return EngineMetrics()
    return parse_trtllm_stats(text) if text.lstrip().startswith("[") else parse_trtllm_prometheus(text)
