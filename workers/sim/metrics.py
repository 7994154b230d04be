"""`/metrics` with vLLM 0.32's full metric set: names, labels, help texts and histogram buckets.

Labels: `engine="0"`, `model_name=<first served name>`; extra label sets as vLLM (finished_reason,
reason, source, sleep_state; `cache_config_info` carries the cache config as labels). The set of
names equals the golden capture in tests/fixtures/vllm/metrics.txt. Gauges are read from the engine
at scrape time; counters/histograms are accumulated by cheap in-process code (a bisect and two adds
per observation) and rendered through a private `prometheus_client.CollectorRegistry`.

Times are **wall-clock seconds as the sim runs** (what a client measures), i.e. profile time divided
by `--speedup`. Per request, like vLLM: queue = first admission - arrival; prefill = first token -
admission; decode = last token - first token; inference = prefill + decode; e2e = finish - arrival;
time per output token = decode / (generated - 1). ITL is observed per output after the first.
Metrics the sim has no notion of (FLOPs/bytes estimates, multimodal/external caches, admission
rejections) are exposed at 0 so dashboards and parsers see vLLM's exact set.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

__all__ = ["CONTENT_TYPE", "FINISH_REASONS", "Histogram", "SimMetrics", "build_1_2_5_buckets"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
         160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQ_TIME = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
             960.0, 1920.0, 7680.0)
_ITER_TOKENS = (1.0, 8.0, *(float(2**k) for k in range(4, 15)))
_N = (1.0, 2.0, 5.0, 10.0, 20.0)
_PREEMPT = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exponent += 1


class Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        acc, out = 0, []
        for b, c in zip((*self.bounds, float("inf")), self.counts):
            acc += c
            out.append(("+Inf" if b == float("inf") else repr(float(b)), float(acc)))
        return out


# name -> (help, buckets or a key into the per-instance token buckets)
_HISTOGRAMS: dict[str, tuple[str, Any]] = {
    "request_prompt_tokens": ("Number of prefill tokens processed.", "tokens"),
    "request_generation_tokens": ("Number of generation tokens processed.", "tokens"),
    "iteration_tokens_total": ("Histogram of number of tokens per engine_step.", _ITER_TOKENS),
    "request_max_num_generation_tokens": ("Histogram of maximum number of requested generation tokens.", "tokens"),
    "request_params_n": ("Histogram of the n request parameter.", _N),
    "request_params_max_tokens": ("Histogram of the max_tokens request parameter.", "tokens"),
    "time_to_first_token_seconds": ("Histogram of time to first token in seconds.", _TTFT),
    "inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", _ITL),
    "request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.", _ITL),
    "e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", _REQ_TIME),
    "request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.", _REQ_TIME),
    "request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.", _REQ_TIME),
    "request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.", _REQ_TIME),
    "request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.", _REQ_TIME),
    "request_num_preemptions": ("Histogram of the number of times a request was preempted.", _PREEMPT),
    "request_prefill_kv_computed_tokens": ("Histogram of new KV tokens computed during prefill (excluding cached tokens).", "tokens"),
}
_ZERO_COUNTERS = (
    ("estimated_flops_per_gpu", "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations)."),
    ("estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations)."),
    ("estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations)."),
)


class SimMetrics:
    def __init__(self, model_name: str, max_model_len: int, gauges: Callable[[], dict[str, float]],
                 cache_info: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self._gauges = gauges  # num_requests_running/waiting, kv_cache_usage_perc, prefix_cache_*, num_preemptions
        self.cache_info = cache_info or {}
        self.created = time.time()
        self.prompt_tokens = 0
        self.prompt_cached = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        tok = build_1_2_5_buckets(max_model_len)
        self.hist = {name: Histogram(tok if b == "tokens" else b) for name, (_doc, b) in _HISTOGRAMS.items()}
        self.ttft = self.hist["time_to_first_token_seconds"]
        self.itl = self.hist["inter_token_latency_seconds"]
        self.iteration_tokens = self.hist["iteration_tokens_total"]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    # ---- recording (engine loop) ---------------------------------------------------------------
    def on_first_token(self, n_prompt: int, n_cached: int) -> None:
        self.prompt_tokens += n_prompt
        self.prompt_cached += n_cached

    def on_finished(self, reason: str, *, arrival: float, admitted: float | None, first_token: float | None,
                    last_token: float | None, now: float, n_prompt: int, n_cached: int, n_gen: int, max_tokens: int,
                    n_preemptions: int) -> None:
        h = self.hist
        self.success[reason if reason in self.success else "error"] += 1
        h["e2e_request_latency_seconds"].observe(now - arrival)
        h["request_prompt_tokens"].observe(n_prompt)
        h["request_generation_tokens"].observe(n_gen)
        h["request_max_num_generation_tokens"].observe(max_tokens)
        h["request_params_max_tokens"].observe(max_tokens)
        h["request_params_n"].observe(1)
        if admitted is None:
            return  # aborted while waiting: vLLM records no phase times
        h["request_queue_time_seconds"].observe(admitted - arrival)
        h["request_num_preemptions"].observe(n_preemptions)
        h["request_prefill_kv_computed_tokens"].observe(max(0, n_prompt - n_cached))
        prefill = (first_token or now) - admitted
        decode = (last_token - first_token) if first_token is not None and last_token is not None else 0.0
        h["request_prefill_time_seconds"].observe(prefill)
        h["request_decode_time_seconds"].observe(decode)
        h["request_inference_time_seconds"].observe(prefill + decode)
        if n_gen > 1:
            h["request_time_per_output_token_seconds"].observe(decode / (n_gen - 1))

    # ---- exposition ----------------------------------------------------------------------------
    def _counter(self, name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
        c = CounterMetricFamily(f"vllm:{name}", doc, labels=labels)
        for lv, v in rows:
            c.add_metric(lv, float(v), created=self.created)
        return c

    def _gauge(self, name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
        g = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
        for lv, v in rows:
            g.add_metric(lv, float(v))
        return g

    def collect(self) -> Iterable[Metric]:
        L, lv = ["engine", "model_name"], ["0", self.model_name]
        g = self._gauges()
        for name, doc in _ZERO_COUNTERS:
            yield self._counter(name, doc, L, [(lv, 0.0)])
        yield self._gauge("num_requests_running", "Number of requests in model execution batches.", L, [(lv, g["num_requests_running"])])
        yield self._gauge("num_requests_waiting", "Number of requests waiting to be processed.", L, [(lv, g["num_requests_waiting"])])
        yield self._gauge(
            "num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = "
            "deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*L, "reason"], [([*lv, "capacity"], g["num_requests_waiting"] - g.get("num_requests_waiting_deferred", 0.0)),
                             ([*lv, "deferred"], g.get("num_requests_waiting_deferred", 0.0))],
        )
        yield self._gauge(
            "engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 "
            "means sleep level 1; discard_all = 1 means sleep level 2.",
            [*L, "sleep_state"], [([*lv, "awake"], 1.0), ([*lv, "weights_offloaded"], 0.0), ([*lv, "discard_all"], 0.0)],
        )
        yield self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", L, [(lv, g["kv_cache_usage_perc"])])
        hits = g["prefix_cache_hits"]
        for name, value, doc in (
            ("prefix_cache_queries", g["prefix_cache_queries"], "Prefix cache queries, in terms of number of queried tokens."),
            ("prefix_cache_hits", hits, "Prefix cache hits, in terms of number of cached tokens."),
            ("external_prefix_cache_queries", g.get("external_kv_tokens", 0.0), "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens."),
            ("external_prefix_cache_hits", g.get("external_kv_tokens", 0.0), "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens."),
            ("mm_cache_queries", 0.0, "Multi-modal cache queries, in terms of number of queried items."),
            ("mm_cache_hits", 0.0, "Multi-modal cache hits, in terms of number of cached items."),
            ("num_preemptions", g["num_preemptions"], "Cumulative number of preemption from the engine."),
            ("prompt_tokens", self.prompt_tokens, "Number of prefill tokens processed."),
        ):
            yield self._counter(name, doc, L, [(lv, value)])
        yield self._counter("prompt_tokens_by_source", "Number of prompt tokens by source.", [*L, "source"], [
            ([*lv, "local_compute"], self.prompt_tokens - self.prompt_cached - g.get("external_kv_tokens", 0.0)),
            ([*lv, "local_cache_hit"], self.prompt_cached), ([*lv, "external_kv_transfer"], g.get("external_kv_tokens", 0.0))])
        yield self._counter("prompt_tokens_cached", "Number of cached prompt tokens (local + external).", L, [(lv, self.prompt_cached)])
        yield self._counter(
            "prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p "
            "(transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits "
            "+ vllm:external_prefix_cache_hits.",
            [*L, "source"], [([*lv, s], hits if s == "device" else 0.0) for s in ("device", "host", "p2p", "disk", "external_unspecified")],
        )
        yield self._counter("generation_tokens", "Number of generation tokens processed.", L, [(lv, self.generation_tokens)])
        yield self._counter("request_success", "Count of successfully processed requests.", ["engine", "finished_reason", "model_name"],
                            [(["0", r, self.model_name], n) for r, n in self.success.items()])
        yield self._counter("admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
                            ["model_name", "reason"], [([self.model_name, r], 0.0) for r in ("max_num_queued_reqs", "max_num_queued_tokens")])
        for name, (doc, _b) in _HISTOGRAMS.items():
            h = self.hist[name]
            m = HistogramMetricFamily(f"vllm:{name}", doc, labels=L)
            m.add_metric(lv, h.buckets(), h.sum)
            yield m
        if self.cache_info:
            info = dict(sorted({**self.cache_info, "engine": "0"}.items()))
            yield self._gauge("cache_config_info", "Information of the LLMEngine CacheConfig", list(info), [(list(info.values()), 1.0)])

    def render(self) -> bytes:
        return generate_latest(self.registry)
