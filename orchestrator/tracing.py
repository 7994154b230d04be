"""OpenTelemetry request tracing (off by default): one trace from the client through the frontend to the engine.

    frontend.telemetry.tracing: {enabled: true, endpoint: http://tempo:4317}   # OTLP/gRPC (or protocol: http/protobuf)

Spans (the SDK's TracerProvider with a BatchSpanProcessor and the OTLP exporter; this process's own provider, the
global one is left alone):

    POST /v1/chat/completions        SERVER span per inference request (TracingMiddleware): the whole exchange,
      │                              streamed body included; joins the client's trace when it sends `traceparent`
      ├─ kvyard.tokenize             prompt tokens (chat template applied)
      ├─ kvyard.admission            the wait in the model's admission queue
      ├─ kvyard.route                policy, chosen worker, its overlap blocks and cost, candidates
      ├─ kvyard.engine_attempt       each POST to an engine until its headers (worker, phase prefill|decode|aggregated,
      │                              attempt, status or error); W3C `traceparent` goes with it, so an engine that
      │                              traces (vLLM --otlp-traces-endpoint) puts its spans under this one
      └─ kvyard.migration            a broken stream continued on another worker

Off, `Tracing.off()` hands out one shared no-op context manager and every hook is a method call that returns at
once; the middleware is not installed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["TracingConfig", "Tracing", "TracingMiddleware", "TRACED_PATHS", "inference_route"]

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize"})
_NOOP = contextlib.nullcontext()


class TracingConfig(BaseModel):
    """OpenTelemetry tracing (YAML `frontend.telemetry.tracing`)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="export a trace per request over OTLP")
    endpoint: str = Field("http://127.0.0.1:4317", description="the OTLP collector (Jaeger, Tempo, an OpenTelemetry "
                                                               "Collector): host:4317 for grpc, http://host:4318/v1/traces for http/protobuf")
    protocol: Literal["grpc", "http/protobuf"] = Field("grpc", description="OTLP transport")
    insecure: bool = Field(True, description="grpc: plain text to the collector (false: TLS)")
    service_name: str = Field("kvyard-frontend", min_length=1, description="the service.name resource attribute")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of new traces recorded (a client's sampled "
                                                             "traceparent is always followed)")
    propagate: bool = Field(True, description="send the W3C traceparent to the engines, so their spans join the trace")


class Tracing:
    """The frontend's tracer and its hooks; `Tracing.off()` when disabled (every hook a no-op)."""

    enabled = False

    def __init__(self, cfg: TracingConfig | None = None, exporter: Any = None) -> None:
        """`exporter`: a SpanExporter to use instead of OTLP (tests: InMemorySpanExporter, exported synchronously)."""
        self.cfg = cfg or TracingConfig()
        self.provider = None
        self.tracer = None
        if cfg is None and exporter is None:
            return
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(resource=Resource.create({"service.name": self.cfg.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(self.cfg.sample_ratio)))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            self.provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(self.cfg)))
        self.tracer = self.provider.get_tracer("kvyard.frontend")
        self.enabled = True

    @classmethod
    def off(cls) -> "Tracing":
        return _Off()

    @classmethod
    def from_config(cls, cfg: TracingConfig) -> "Tracing":
        return cls(cfg) if cfg.enabled else cls.off()

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()  # flushes what the batch processor holds

    # ---- hooks (each returns at once when tracing is off) ----------------------------------------------

    def _recording(self) -> bool:
        """Inside a request's recorded span (a request outside any, e.g. over gRPC, or not sampled: no child spans)."""
        return self.enabled and self._trace.get_current_span().is_recording()

    def span(self, name: str, **attributes: Any):
        """A child span of the current one, as a context manager (the shared no-op one when off)."""
        if not self._recording():
            return _NOOP
        return self.tracer.start_as_current_span(name, attributes=_clean(attributes))

    def annotate(self, **attributes: Any) -> None:
        """Attributes on the current span (the request's, outside any child)."""
        if self._recording():
            self._trace.get_current_span().set_attributes(_clean(attributes))

    def route(self, decision, candidates: int, decision_s: float) -> None:
        """A kvyard.route span for a decision just taken (its duration: the router's own decision time)."""
        if not self._recording():
            return
        chosen = decision.ranked[0]
        end = time.time_ns()
        start = end - int(decision_s * 1e9)
        cost = decision.scores.get(chosen.worker_id)
        span = self.tracer.start_span("kvyard.route", start_time=start, attributes=_clean({
            "kvyard.policy": decision.policy, "kvyard.worker": chosen.worker_id, "kvyard.candidates": candidates,
            "kvyard.overlap_blocks": decision.overlap_of(chosen), "kvyard.cost": cost,
            "kvyard.best_overlap_blocks": max(decision.overlap_blocks.values(), default=0)}))
        span.end(end_time=end)

    def attempt(self, ep, attempt: int, headers: dict[str, str]) -> tuple[dict[str, str], Any]:
        """(headers to send, span) of one POST to an engine: a kvyard.engine_attempt span (ended by `end_attempt`)
        and the headers with its traceparent; off: (headers, None)."""
        if not self._recording():
            return headers, None
        phase = ep.role if ep.role in ("prefill", "decode") else "aggregated"
        span = self.tracer.start_span("kvyard.engine_attempt", attributes={
            "kvyard.worker": ep.worker_id, "kvyard.phase": phase, "kvyard.attempt": attempt, "server.address": ep.url})
        if self.cfg.propagate:
            headers = dict(headers)
            self._propagator.inject(headers, context=self._trace.set_span_in_context(span))
        return headers, span

    def end_attempt(self, span: Any, post: Any = None, status: int | None = None, error: str | None = None) -> None:
        """End an attempt's span with its outcome: the engine's status, or why it failed (`post`: the POST's future)."""
        if span is None:
            return
        if post is not None and post.done():
            if post.cancelled():
                error = "cancelled"
            elif post.exception() is not None:
                error = f"{type(post.exception()).__name__}: {post.exception()}"
            else:
                status = post.result().status_code
        elif post is not None:
            error = "cancelled"
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None or (status is not None and status >= 500):
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error or f"HTTP {status}"))
        span.end()

    @contextlib.contextmanager
    def server_span(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> Iterator[Any]:
        parent = self._propagator.extract({k.decode("latin-1"): v.decode("latin-1") for k, v in headers
                                           if k in (b"traceparent", b"tracestate")})
        with self.tracer.start_as_current_span(f"{method} {path}", context=parent, kind=self._trace.SpanKind.SERVER,
                                               attributes={"http.request.method": method, "url.path": path}) as span:
            yield span


class _Off(Tracing):
    """Tracing off: every hook returns at once (no check of a current span, no attributes built)."""

    def __init__(self) -> None:
        super().__init__()

    def span(self, name: str, **attributes: Any):
        return _NOOP

    def annotate(self, **attributes: Any) -> None:
        pass

    def route(self, decision, candidates: int, decision_s: float) -> None:
        pass

    def attempt(self, ep, attempt: int, headers: dict[str, str]) -> tuple[dict[str, str], Any]:
        return headers, None

    def end_attempt(self, span: Any, post: Any = None, status: int | None = None, error: str | None = None) -> None:
        pass


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


def _otlp_exporter(cfg: TracingConfig):
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=cfg.endpoint, insecure=cfg.insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=cfg.endpoint)


def inference_route(scope) -> str | None:
    """The route template of an HTTP request to an inference path (what the tracing and access-log middlewares
    wrap), else None; never the raw path of a response id."""
    if scope["type"] != "http":
        return None
    path = scope.get("path", "")
    if path in TRACED_PATHS:
        return path
    return "/v1/responses/{response_id}" if path.startswith("/v1/responses/") else None


class TracingMiddleware:
    """Pure ASGI: a SERVER span around each request to an inference path, streamed body included, with its status."""

    def __init__(self, app, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope, receive, send) -> None:
        route = inference_route(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        with self.tracing.server_span(scope["method"], route, scope.get("headers") or []) as span:
            async def traced_send(message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(self.tracing._trace.Status(self.tracing._trace.StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, traced_send)
