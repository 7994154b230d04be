"""An OTLP/gRPC trace receiver on 127.0.0.1 (a test double of a collector such as Jaeger or Tempo): what the frontend
and an engine export lands in `spans`.

    with OtlpReceiver() as rx:           # rx.endpoint: "http://127.0.0.1:<port>"
        ...
        rx.wait_for(lambda spans: ..., timeout=30)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from orchestrator.testing.fake_engine import free_port

__all__ = ["OtlpReceiver", "ReceivedSpan"]


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    attributes: dict


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, rx: "OtlpReceiver") -> None:
        self.rx = rx

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                            {a.key: _value(a.value) for a in s.attributes}))
        with self.rx.lock:
            self.rx.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)

    def __enter__(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0)
