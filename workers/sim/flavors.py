"""What the sim exposes when it plays SGLang or TensorRT-LLM instead of vLLM (`--flavor`).

SGLang (`srt/observability/metrics_collector.py`):
- `/metrics` in SGLang's names, labels `engine_type` (unified|prefill|decode), `model_name`, `tp_rank`:
  gauges `sglang:num_running_reqs`, `num_queue_reqs` (waiting, without decode requests whose KV is in
  flight), `num_used_tokens`, `token_usage`, `cache_hit_rate`, `gen_throughput` (tokens/s since the
  previous scrape); PD gauges `num_prefill_bootstrap_queue_reqs` (0: the sim's prefill does not wait
  for the decode's handshake), `num_prefill_inflight_queue_reqs` (finished prefills whose KV awaits its
  decode), `num_decode_prealloc_queue_reqs` (0: the sim allocates at admission),
  `num_decode_transfer_queue_reqs` (KV in flight); counters `prompt_tokens_total`,
  `generation_tokens_total`, `cached_tokens_total`, `num_requests_total`; histograms
  `time_to_first_token_seconds`, `inter_token_latency_seconds`, `e2e_request_latency_seconds` (the
  sim's vLLM buckets, not SGLang's).
- KV events in SGLang's msgpack format (`workers.sglang.kv_events.encode_batch`: tagged maps, signed
  int64 hashes), one event per page; the hash *values* stay vLLM's sha256 ids (SGLang chains
  sha256 over little-endian uint32 token ids), which only matters to a consumer that recomputes them.
  SGLang's `--kv-events-config` has no `enable_kv_cache_events`: `"publisher":"zmq"` turns it on.

TensorRT-LLM (`serve/openai_server.py`):
- `POST /kv_cache_events`: the buffered events as trtllm-serve's JSON list, drained per call
  (`workers.trtllm.kv_events.encode_events`); the buffer keeps the newest 10000 events (an
  `event_id` gap tells the consumer some were lost).
- `GET /metrics`: JSON iteration stats, drained per call: one object per engine step with `iter`,
  `iterLatencyMS`, `numActiveRequests`, `numQueuedRequests`, `numCompletedRequests`,
  `maxNumActiveRequests`, `timestamp`, `kvCacheStats` {maxNumBlocks, freeNumBlocks, usedNumBlocks,
  tokensPerBlock, allocTotalBlocks, allocNewBlocks, reusedBlocks, missedBlocks, cacheHitRate} and
  `inflightBatchingStats` {numScheduledRequests, numContextRequests, numGenRequests, numCtxTokens}.
  The key names follow TRT-LLM's IterationStats JSON as remembered, not checked against a release.
- `GET /prometheus/metrics`: `trtllm_*` Prometheus names (see TrtllmPrometheus).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from router.kv_events import BlockStored, KvEvent
from workers.sim.metrics import SimMetrics

__all__ = [
    "SglangMetrics",
    "TrtllmEventBuffer",
    "TrtllmIterationStats",
    "TrtllmPrometheus",
    "split_per_page",
]

TRTLLM_EVENT_BUFFER = 10000
TRTLLM_STATS_BUFFER = 1000


def split_per_page(events: Iterable[KvEvent]) -> list[KvEvent]:
    """SGLang publishes one BlockStored per page: split the sim's multi-block events, chaining parents."""
    out: list[KvEvent] = []
    for ev in events:
        if isinstance(ev, BlockStored) and len(ev.block_hashes) > 1:
            bs, parent = ev.block_size, ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                out.append(BlockStored([h], parent, ev.token_ids[i * bs:(i + 1) * bs], bs, lora_name=ev.lora_name, medium=ev.medium))
                parent = h
        else:
            out.append(ev)
    return out


def _families(kind, prefix: str, rows, labels: list[str], values: list[str]):
    """One metric family of `kind` (Gauge/CounterMetricFamily) per (name, doc, value) row, with one labelled sample."""
    for name, doc, value in rows:
        m = kind(f"{prefix}{name}", doc, labels=labels)
        m.add_metric(values, float(value))
        yield m


def _histograms(prefix: str, hists, rows, labels: list[str], values: list[str]):
    """One histogram family per (name, key into `hists`, doc) row: the engine's own buckets and sum."""
    for name, key, doc in rows:
        h = hists[key]
        m = HistogramMetricFamily(f"{prefix}{name}", doc, labels=labels)
        m.add_metric(values, h.buckets(), h.sum)
        yield m


class SglangMetrics:
    """SGLang's Prometheus names over the sim's own counters (see the module docstring)."""

    def __init__(self, base: SimMetrics, gauges: Callable[[], dict[str, float]], engine_type: str, kv_tokens: int) -> None:
        self.base, self._gauges, self.engine_type, self.kv_tokens = base, gauges, engine_type, kv_tokens
        self._last: tuple[float, float] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    def collect(self) -> Iterable[Metric]:
        b, g = self.base, self._gauges()
        L, lv = ["engine_type", "model_name", "tp_rank"], [self.engine_type, b.model_name, "0"]
        now = time.monotonic()
        rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = (b.generation_tokens - self._last[1]) / (now - self._last[0])
        self._last = (now, float(b.generation_tokens))
        queries = g["prefix_cache_queries"]
        deferred = g.get("num_requests_waiting_deferred", 0.0)
        yield from _families(GaugeMetricFamily, "sglang:", (
            ("num_running_reqs", "The number of running requests.", g["num_requests_running"]),
            ("num_queue_reqs", "The number of requests in the waiting queue.", g["num_requests_waiting"] - deferred),
            ("num_used_tokens", "The number of used tokens.", round(g["kv_cache_usage_perc"] * self.kv_tokens)),
            ("token_usage", "The token usage.", g["kv_cache_usage_perc"]),
            ("cache_hit_rate", "The prefix cache hit rate.", g["prefix_cache_hits"] / queries if queries else 0.0),
            ("gen_throughput", "The generation throughput (token/s).", rate),
            ("num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.", 0.0),
            ("num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue.", g.get("num_held", 0.0)),
            ("num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", 0.0),
            ("num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue.", deferred),
        ), L, lv)
        yield from _families(CounterMetricFamily, "sglang:", (
            ("prompt_tokens", "Number of prefill tokens processed.", b.prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.", b.generation_tokens),
            ("cached_tokens", "Number of cached prompt tokens.", b.prompt_cached),
            ("num_requests", "Number of requests processed.", sum(b.success.values())),
        ), L, lv)
        yield from _histograms("sglang:", b.hist, (
            ("time_to_first_token_seconds", "time_to_first_token_seconds", "Histogram of time to first token in seconds."),
            ("inter_token_latency_seconds", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
            ("e2e_request_latency_seconds", "e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds"),
        ), L, lv)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TrtllmEventBuffer:
    """KV events waiting for `POST /kv_cache_events` (numbered from 0 like TRT-LLM's event ids)."""

    def __init__(self, maxlen: int = TRTLLM_EVENT_BUFFER) -> None:
        self.events: deque[tuple[int, KvEvent]] = deque(maxlen=maxlen)
        self.next_id = 0

    def publish(self, events: list[KvEvent]) -> None:
        for ev in events:
            self.events.append((self.next_id, ev))
            self.next_id += 1

    def drain(self) -> list[tuple[int, KvEvent]]:
        out = list(self.events)
        self.events.clear()
        return out


class TrtllmIterationStats:
    """Per-step stats for TRT-LLM's JSON `/metrics`, drained per call (newest `maxlen` kept)."""

    def __init__(self, gauges: Callable[[], dict[str, float]], num_blocks: int, block_size: int, max_num_seqs: int,
                 maxlen: int = TRTLLM_STATS_BUFFER) -> None:
        self._gauges, self.num_blocks, self.block_size, self.max_num_seqs = gauges, num_blocks, block_size, max_num_seqs
        self.stats: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self.iter = 0
        self.completed = 0

    def record(self, step_ms: float, num_ctx: int, num_gen: int, ctx_tokens: int, completed: int) -> None:
        g = self._gauges()
        usable = self.num_blocks - 1
        used = round(g["kv_cache_usage_perc"] * usable)
        queries, hits = g["prefix_cache_queries"], g["prefix_cache_hits"]
        self.completed += completed
        self.stats.append({
            "iter": self.iter, "iterLatencyMS": step_ms, "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
            "numActiveRequests": int(g["num_requests_running"]), "numQueuedRequests": int(g["num_requests_waiting"]),
            "numCompletedRequests": completed, "maxNumActiveRequests": self.max_num_seqs,
            "kvCacheStats": {"maxNumBlocks": usable, "freeNumBlocks": usable - used, "usedNumBlocks": used,
                             "tokensPerBlock": self.block_size, "allocTotalBlocks": used, "allocNewBlocks": 0,
                             "reusedBlocks": int(hits) // self.block_size, "missedBlocks": int(queries - hits) // self.block_size,
                             "cacheHitRate": hits / queries if queries else 0.0},
            "inflightBatchingStats": {"numScheduledRequests": num_ctx + num_gen, "numContextRequests": num_ctx,
                                      "numGenRequests": num_gen, "numCtxTokens": ctx_tokens, "numPausedRequests": 0,
                                      "microBatchId": 0},
        })  # fmt: skip
        self.iter += 1

    def drain(self) -> list[dict[str, Any]]:
        out = list(self.stats)
        self.stats.clear()
        return out


class TrtllmPrometheus:
    """TRT-LLM's `/prometheus/metrics` (`tensorrt_llm/metrics/collector.py`, prefix `trtllm_`, label
    `model_name`): request gauges, KV utilisation and hit rate, latency histograms (the sim's vLLM
    buckets) and `trtllm_request_success_total{finished_reason}`."""

    def __init__(self, base: SimMetrics, gauges: Callable[[], dict[str, float]]) -> None:
        self.base, self._gauges = base, gauges
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    def collect(self) -> Iterable[Metric]:
        b, g = self.base, self._gauges()
        L, lv = ["model_name"], [b.model_name]
        queries = g["prefix_cache_queries"]
        yield from _families(GaugeMetricFamily, "trtllm_", (
            ("num_requests_running", "Number of requests currently running.", g["num_requests_running"]),
            ("num_requests_waiting", "Number of requests waiting to be scheduled.", g["num_requests_waiting"]),
            ("kv_cache_utilization", "KV cache utilization (0-1).", g["kv_cache_usage_perc"]),
            ("kv_cache_hit_rate", "KV cache hit rate (0-1).", g["prefix_cache_hits"] / queries if queries else 0.0),
        ), L, lv)
        c = CounterMetricFamily("trtllm_request_success", "Count of successfully processed requests.", labels=["model_name", "finished_reason"])
        for reason, n in b.success.items():
            c.add_metric([b.model_name, reason], float(n))
        yield c
        yield from _histograms("trtllm_", b.hist, (
            ("time_to_first_token_seconds", "time_to_first_token_seconds", "Histogram of time to first token in seconds."),
            ("time_per_output_token_seconds", "request_time_per_output_token_seconds", "Histogram of time per output token in seconds."),
            ("e2e_request_latency_seconds", "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds."),
            ("request_queue_time_seconds", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
        ), L, lv)

    def render(self) -> bytes:
        return generate_latest(self.registry)
