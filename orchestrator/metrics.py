"""The frontend's Prometheus metrics (one private registry per app, served on /metrics)."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["FrontendMetrics", "BatchedObserver"]

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
_TOK = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._children: dict[tuple, object] = {}  # child() below
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
        self.best_overlap_blocks = Counter(
            "kvyard_router_best_overlap_blocks", "Prompt blocks cached on the worker holding most of the prompt, chosen or not "
            "(minus kvyard_router_overlap_blocks: the cache affinity given up to balance load)", ["model"], registry=r)
        self.prompt_blocks = Counter("kvyard_router_prompt_blocks", "Full prompt blocks routed", ["model"], registry=r)
        self.retries = Counter("kvyard_engine_retries", "Requests re-sent to another engine before streaming", ["model"], registry=r)
        self.fields_removed = Counter("kvyard_request_fields_removed", "Top-level fields removed from client requests before "
                                      "the engine saw them (engine_internal | unknown)", ["reason"], registry=r)
        self.connections_closed = Counter("kvyard_connections_closed", "Client connections closed by the frontend's guards "
                                          "(headers_timeout | body_timeout | too_many_connections)", ["reason"], registry=r)
        self.workers = Gauge("kvyard_workers", "Live workers by model and state", ["model", "state"], registry=r)
        # security (orchestrator/security): refused credentials and rate-limited keys
        self.auth_failures = Counter("kvyard_auth_failures", "Requests refused for their credentials, by surface "
                                     "(http | grpc | admin) and reason (missing | invalid | revoked | disabled)", ["surface", "reason"], registry=r)
        self.rate_limited = Counter("kvyard_rate_limited", "Requests refused 429 by their API key's limit (requests | tokens)",
                                    ["key_id", "limit"], registry=r)
        # reliability (orchestrator/resilience): breakers, migrations, admission, deadlines
        self.breaker_state = Gauge("kvyard_breaker_state", "Circuit breaker of a worker: 0 closed, 1 half-open, 2 open", ["worker"], registry=r)
        self.breaker_transitions = Counter("kvyard_breaker_transitions", "Breaker state changes by worker and new state", ["worker", "state"], registry=r)
        self.migrations = Counter("kvyard_migrations", "Mid-stream continuations on another worker, by outcome "
                                  "(migrated | refused: not migratable | exhausted: limit or no worker left | failed)", ["model", "outcome"], registry=r)
        self.admission_queue = Gauge("kvyard_admission_queue", "Requests waiting for admission", ["model"], registry=r)
        self.admission_rejected = Counter("kvyard_admission_rejected", "Requests refused 503 by admission (queue_full | queue_timeout)", ["model", "reason"], registry=r)
        self.admission_wait = Histogram("kvyard_admission_wait_seconds", "Time queued before admission", ["model"], buckets=_LAT, registry=r)
        self.deadline_exceeded = Counter("kvyard_request_deadline_exceeded", "Requests ended by request_timeout_s", ["model"], registry=r)
        # disaggregated prefill/decode (orchestrator/disagg): mode remote|local|fallback|rejected, reason as decided
        self.disagg_decisions = Counter("kvyard_disagg_decisions", "Where each request of a disaggregated model was prefilled, and why",
                                        ["mode", "reason"], registry=r)
        # the event loop itself (orchestrator/loopwatch.py): how late it turns, and stalls past loop_stall_s
        self.loop_lag = Histogram("kvyard_event_loop_lag_seconds", "How late the frontend's event loop ran a timer",
                                  buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.gc_pause = Histogram("kvyard_gc_pause_seconds", "How long each garbage collection stopped the frontend "
                                  "(orchestrator/heap.py)", ["generation"],
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.loop_stalls = Counter("kvyard_event_loop_stalls", "Times the frontend's event loop ran later than loop_stall_s", registry=r)
        self.disagg_prefill = Histogram("kvyard_disagg_prefill_seconds", "Remote prefill: request sent to hand-off received",
                                        ["model"], buckets=_LAT, registry=r)

    def child(self, metric, *values: str):
        """`metric.labels(*values)`, remembered: the request path asks for the same per-model series ~13 times a
        request, and `labels()` (a lock, a tuple, a dict) costs ~2 us each. Only for series never removed (no
        `worker` label: forget_worker removes those); bounded all the same."""
        key = (metric, values)
        c = self._children.get(key)
        if c is None:
            if len(self._children) >= 4096:
                self._children.clear()
            c = self._children[key] = metric.labels(*values)
        return c

    def forget_worker(self, worker_id: str) -> None:
        """Remove every series labelled with this worker (called when it leaves the pool), so a fleet that churns
        does not grow /metrics without bound."""
        for metric in (self.routed, self.breaker_state, self.breaker_transitions):
            names = metric._labelnames
            stale = {tuple(s.labels[n] for n in names) for fam in metric.collect() for s in fam.samples
                     if s.labels.get("worker") == worker_id}
            for values in stale:
                metric.remove(*values)


class BatchedObserver:
    """A histogram child's observations, counted locally and added to it every `every` observations and on `flush`.

    The relay observes every inter-token gap of every stream; `Histogram.observe` takes two locks and walks the
    buckets (~2 us), this a bisect and a list increment. The histogram shows the same counts and sum, at most
    `every` gaps (and one stream's end) late. Falls back to plain `observe` if prometheus_client's child layout
    (`_upper_bounds`, `_buckets`, `_sum`) is not there."""

    __slots__ = ("_child", "_bounds", "_counts", "_sum", "_n", "_every", "observe")

    def __init__(self, child, every: int = 64) -> None:
        self._child, self._every = child, every
        self._bounds = getattr(child, "_upper_bounds", None)
        if self._bounds is None or not hasattr(child, "_buckets") or not hasattr(child, "_sum"):
            self.observe = child.observe
            self._counts = None
            return
        self._counts = [0] * len(self._bounds)
        self._sum, self._n = 0.0, 0
        self.observe = self._observe

    def _observe(self, amount: float) -> None:
        self._counts[bisect_left(self._bounds, amount)] += 1  # the first bucket whose bound is >= amount (+Inf last)
        self._sum += amount
        self._n += 1
        if self._n >= self._every:
            self.flush()

    def flush(self) -> None:
        if not self._counts or not self._n:
            return
        self.add(self._counts, self._sum, self._n)
        self._counts = [0] * len(self._counts)
        self._sum, self._n = 0.0, 0

    @property
    def bounds(self) -> tuple[float, ...] | None:
        """The histogram's bucket upper bounds (+Inf last) when counts can be added in batches (`add`), else None."""
        return tuple(self._bounds) if self._counts is not None else None

    def add(self, counts: list[int], total: float, n: int) -> None:
        """Add `n` observations summing to `total`, `counts[i]` of them in bucket i (counted by the caller, as the
        SSE relay does: orchestrator/streaming.py)."""
        child = self._child
        child._sum.inc(total)
        for i, k in enumerate(counts):
            if k:
                child._buckets[i].inc(k)
