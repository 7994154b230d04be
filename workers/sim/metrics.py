"""`/metrics` with vLLM 0.32's metric names, labels and histogram buckets (engines.md §2).

Labels: `engine="0"`, `model_name=<first served name>` (`finished_reason` on request_success_total,
pre-populated with vLLM's five reasons). Gauges are read from the engine at scrape time; counters and
histograms are accumulated by cheap in-process code (a bisect and two adds per observation) and
rendered through a private `prometheus_client.CollectorRegistry`.

Times are **wall-clock seconds as the sim runs** (what a client measures), i.e. profile time divided
by `--speedup`. Counted like vLLM: TTFT at the first token, ITL between later outputs of a request,
queue time = first admission - arrival, e2e = finish - arrival, prompt/generation tokens per request
at finish, prompt_tokens_total at the first token, generation_tokens_total per sampled token.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

__all__ = ["SimMetrics", "Histogram", "build_1_2_5_buckets", "FINISH_REASONS"]

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


class SimMetrics:
    def __init__(self, model_name: str, max_model_len: int, gauges: Callable[[], dict[str, float]]) -> None:
        self.model_name = model_name
        self._gauges = gauges  # num_requests_running, num_requests_waiting, kv_cache_usage_perc, prefix_*
        self.created = time.time()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        tok = build_1_2_5_buckets(max_model_len)
        self.hist = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "request_queue_time_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "request_prompt_tokens": Histogram(tok),
            "request_generation_tokens": Histogram(tok),
        }
        self.ttft = self.hist["time_to_first_token_seconds"]
        self.itl = self.hist["inter_token_latency_seconds"]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    # ---- recording (engine loop) ---------------------------------------------------------------
    def on_finished(self, reason: str, arrival: float, admitted: float | None, now: float, n_prompt: int, n_gen: int) -> None:
        self.success[reason if reason in self.success else "error"] += 1
        self.hist["e2e_request_latency_seconds"].observe(now - arrival)
        if admitted is not None:
            self.hist["request_queue_time_seconds"].observe(admitted - arrival)
        self.hist["request_prompt_tokens"].observe(n_prompt)
        self.hist["request_generation_tokens"].observe(n_gen)

    # ---- exposition ----------------------------------------------------------------------------
    def collect(self) -> Iterable[Metric]:
        labels = ["engine", "model_name"]
        lv = ["0", self.model_name]
        g = self._gauges()
        for name, doc in (
            ("num_requests_running", "Number of requests in model execution batches."),
            ("num_requests_waiting", "Number of requests waiting to be processed."),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        ):
            m = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
            m.add_metric(lv, float(g.get(name, 0.0)))
            yield m
        for name, value, doc in (
            ("prefix_cache_queries", g.get("prefix_cache_queries", 0.0), "Prefix cache queries, in terms of number of queried tokens."),
            ("prefix_cache_hits", g.get("prefix_cache_hits", 0.0), "Prefix cache hits, in terms of number of cached tokens."),
            ("num_preemptions", g.get("num_preemptions", 0.0), "Cumulative number of preemption from the engine."),
            ("prompt_tokens", self.prompt_tokens, "Number of prefill tokens processed."),
            ("generation_tokens", self.generation_tokens, "Number of generation tokens processed."),
        ):
            c = CounterMetricFamily(f"vllm:{name}", doc, labels=labels)
            c.add_metric(lv, float(value), created=self.created)
            yield c
        c = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.", labels=["engine", "finished_reason", "model_name"])
        for reason, n in self.success.items():
            c.add_metric(["0", reason, self.model_name], float(n), created=self.created)
        yield c
        docs = {
            "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
            "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
            "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
            "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
            "request_prompt_tokens": "Number of prefill tokens processed.",
            "request_generation_tokens": "Number of generation tokens processed.",
        }
        for name, h in self.hist.items():
            m = HistogramMetricFamily(f"vllm:{name}", docs[name], labels=labels)
            m.add_metric(lv, h.buckets(), h.sum, timestamp=None)
            yield m

    def render(self) -> bytes:
        return generate_latest(self.registry)
