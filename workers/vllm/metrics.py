"""vLLM's Prometheus `/metrics` text -> `EngineMetrics` (vLLM 0.32's names).

Samples are matched on their exposed name (counters keep their `_total` suffix) and summed over
all label sets, i.e. over `engine` (data-parallel ranks) and `model_name`, except the KV-cache
usage fraction, which is averaged over engines so it stays in [0, 1]. Older names are accepted
as fallbacks where a release used a different one.

Parsing never raises: the sample lines of the wanted metrics are picked out first (a full
exposition is ~700 lines and the parser is slow), parsed with `prometheus_client.parser` in one
go, and if the parser rejects any of them, again line by line, skipping the lines it cannot read. NaN and
infinite samples are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

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


def _samples(text: str) -> Iterable[tuple[str, float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.value


def _wanted_lines(text: str) -> list[str]:
    """Only the sample lines we read: the full exposition is ~700 lines and the parser is slow."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in _WANTED:
                out.append(line)
    return out


def _collect(text: str) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}

    def add(pairs: Iterable[tuple[str, float]]) -> None:
        for name, value in pairs:
            if name in _WANTED and isinstance(value, (int, float)) and math.isfinite(value):
                values.setdefault(name, []).append(float(value))

    lines = _wanted_lines(text)
    try:
        add(list(_samples("\n".join(lines) + "\n")))
        return values
    except Exception:  # noqa: BLE001 - the parser raises assorted errors on junk; fall back per line
        values.clear()
    for line in lines:
        try:
            add(list(_samples(line + "\n")))
        except Exception:  # noqa: BLE001 - skip the unreadable line
            continue
    return values


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Normalise one scrape of a vLLM server's `/metrics`. Missing metrics read as 0."""
    values = _collect(text if isinstance(text, str) else "")
    out = EngineMetrics()
    for field, names in METRIC_NAMES.items():
        for name in names:
            if name in values:
                samples = values[name]
                total = sum(samples)
                setattr(out, field, total / len(samples) if field in _AVERAGED else total)
                break
    return out
