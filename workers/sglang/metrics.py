"""SGLang's Prometheus `/metrics` (needs `--enable-metrics`), read into kvyard's EngineMetrics.

Names (SGLang 0.5.23, `srt/observability/metrics_collector.py`), labels
`engine_type`, `model_name`, `tp_rank`:
    sglang:num_running_reqs, num_queue_reqs            gauges -> running / waiting
    sglang:num_decode_prealloc_queue_reqs, num_decode_transfer_queue_reqs,
    sglang:num_prefill_bootstrap_queue_reqs            P/D queues, counted as waiting (vLLM counts a
                                                        decode waiting for its KV as waiting too)
    sglang:token_usage                                  gauge 0..1 -> kv_cache_usage (averaged over ranks)
    sglang:prompt_tokens_total, cached_tokens_total     counters -> prefix-cache queries / hits (tokens)
    sglang:generation_tokens_total                      counter
Values are summed over label sets (one per TP/DP rank); non-finite values are ignored. Never raises.
"""

from __future__ import annotations

from workers.prom_text import samples_by_name
from workers.types import EngineMetrics

__all__ = ["SGLANG_FIELDS", "parse_sglang_metrics"]

SGLANG_FIELDS: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("sglang:num_running_reqs",),
    "num_requests_waiting": ("sglang:num_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
                             "sglang:num_decode_transfer_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs"),
    "kv_cache_usage": ("sglang:token_usage",),
    "prefix_cache_queries": ("sglang:prompt_tokens_total",),
    "prefix_cache_hits": ("sglang:cached_tokens_total",),
    "prompt_tokens": ("sglang:prompt_tokens_total",),
    "generation_tokens": ("sglang:generation_tokens_total",),
}


def parse_sglang_metrics(text: str) -> EngineMetrics:
    """SGLang's Prometheus text -> EngineMetrics (summed over label sets; token_usage averaged). Never raises."""
    values = samples_by_name(text, "sglang:")
    out = EngineMetrics()
    for fld, names in SGLANG_FIELDS.items():
        got = [v for n in names for v in values.get(n, ())]
        if got:
            setattr(out, fld, sum(got) / len(got) if fld == "kv_cache_usage" else sum(got))
    return out
