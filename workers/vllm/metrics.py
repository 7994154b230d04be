"""vLLM's Prometheus `/metrics` text -> `EngineMetrics` (vLLM 0.32's names).

Samples are matched on their exposed name (counters keep their `_total` suffix) and summed over
all label sets, i.e. over `engine` (data-parallel ranks) and `model_name`, except the KV-cache
usage fraction, which is averaged over engines so it stays in [0, 1]. Older names are accepted
as fallbacks where a release used a different one.

Parsing never raises: the sample lines of the wanted metrics are read by one regular expression over the
text (workers/prom_text.py), lines it cannot read are skipped, and NaN and infinite samples are ignored.
"""

from __future__ import annotations

from workers.prom_text import samples_by_name
from workers.types import EngineMetrics

__all__ = ["METRIC_NAMES", "parse_vllm_metrics"]

#: EngineMetrics field -> sample names, first present wins
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "num_preemptions": ("vllm:num_preemptions_total",),
}
_AVERAGED = frozenset({"kv_cache_usage"})
_WANTED = frozenset(name for names in METRIC_NAMES.values() for name in names)


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Normalise one scrape of a vLLM server's `/metrics`. Missing metrics read as 0."""
    values = samples_by_name(text, "vllm:", _WANTED)
    out = EngineMetrics()
    for field, names in METRIC_NAMES.items():
        for name in names:
            if name in values:
                samples = values[name]
                total = sum(samples)
                setattr(out, field, total / len(samples) if field in _AVERAGED else total)
                break
    return out
