"""The gRPC server: KServe v2 inference service + grpc.health.v1 + server reflection, on `grpc.aio`.

It runs on the HTTP frontend's event loop and shares its InferenceService and WorkerPool, so a
request through either transport is routed, limited, counted and answered alike. The app lifespan
starts it after the pool (`start_grpc_server`) and stops it before the pool closes (`GrpcServer.stop`).

Health: service "" and "inference.GRPCInferenceService" are SERVING while at least one worker is ready
(re-checked on every Check and every `health_interval_s` for Watch streams), NOT_SERVING otherwise;
NOT_SERVING for good once shutdown begins. Reflection lists the three services and serves their
descriptors from the stubs' private descriptor pool.

TLS: given `tls` (orchestrator.security.TlsFiles) the port is a secure one (server-side TLS, the
same certificate as HTTPS); clients then need grpc.ssl_channel_credentials with the CA.
Auth: `guard` (orchestrator.security.InferenceGuard) checks API keys in the servicer.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from orchestrator.grpc.generated import POOL, pb_grpc
from orchestrator.grpc.llm import lenient
from orchestrator.grpc.servicer import SERVICE_NAME, InferenceServicer
from orchestrator.pool import WorkerPool
from orchestrator.security import InferenceGuard, TlsFiles
from orchestrator.service import InferenceService

__all__ = ["start_grpc_server", "GrpcServer", "GrpcStartError"]

log = logging.getLogger("kvyard.grpc")

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE = reflection.SERVICE_NAME

# Reflection answers from the private pool that holds the inference messages; give it the health and
# reflection protos too, so every listed service can be described.
for _fd in (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
    try:
        POOL.FindFileByName(_fd.name)
    except KeyError:
        POOL.AddSerializedFile(_fd.serialized_pb)


class GrpcStartError(RuntimeError):
    """The gRPC port could not be bound (in use, or a bad host)."""


_INFER = ("ModelInfer", "ModelStreamInfer")  # the RPCs whose servicer reads its request through llm.completion_body


class _LenientInference:
    """Registers the generated inference handlers with lenient request deserializers: a message protobuf cannot parse
    (invalid UTF-8 in a string field, a truncated buffer) reaches the servicer as `Undecodable` and is answered
    INVALID_ARGUMENT, instead of gRPC's UNKNOWN "Unexpected DecodeError"."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # replaced below, from the same handlers, once they are known by name

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        handlers = {name: h._replace(request_deserializer=lenient(h.request_deserializer)) if name in _INFER else h
                    for name, h in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._server.add_registered_method_handlers(service, handlers)


class _ReadinessHealth(health_aio.HealthServicer):
    """Standard health servicer whose status follows the worker pool."""

    def __init__(self, servicer: InferenceServicer) -> None:
        super().__init__()
        self._servicer = servicer

    async def refresh(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self._servicer.any_ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            if self._server_status.get(name) != status:
                await self.set(name, status)

    async def Check(self, request, context):
        await self.refresh()
        return await super().Check(request, context)


@dataclass
class GrpcServer:
    """A started gRPC server: `port` is the bound port; `stop()` drains, then cancels what is left."""

    server: grpc.aio.Server
    port: int
    health: _ReadinessHealth
    _watch: asyncio.Task

    async def stop(self, grace_s: float = 5.0) -> None:
        self._watch.cancel()
        await asyncio.gather(self._watch, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def _follow_pool(health: _ReadinessHealth, interval_s: float) -> None:
    while True:
        try:
            await health.refresh()
        except Exception:  # the loop must outlive one bad round
            log.exception("health refresh failed")
        await asyncio.sleep(interval_s)


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def start_grpc_server(service: InferenceService, pool: WorkerPool, port: int, host: str = "127.0.0.1",
                            *, health_interval_s: float = 0.5, guard: InferenceGuard | None = None,
                            tls: TlsFiles | None = None) -> GrpcServer:
    """Start the gRPC endpoint on host:port (port 0: any free port, see `.port`) on the running loop."""
    limit = service.cfg.max_body_bytes + 64 * 1024  # room for the protobuf framing around a maximal prompt
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),  # a port already in use must fail here, not be silently shared
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_connection_idle_ms", 300_000),  # a connection with no RPC for 5 min is closed (GOAWAY)
    ])
    servicer = InferenceServicer(service, pool, guard)
    health = _ReadinessHealth(servicer)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, _LenientInference(server))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE, REFLECTION_SERVICE), server, pool=POOL)
    address = _address(host, port)
    try:
        bound = server.add_secure_port(address, tls.grpc_credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise GrpcStartError(f"cannot serve gRPC on {address}: {exc}") from exc
    if not bound:
        raise GrpcStartError(f"cannot serve gRPC on {address}")
    await server.start()
    await health.refresh()
    watch = asyncio.create_task(_follow_pool(health, health_interval_s))
    log.info("gRPC (KServe v2) listening on %s%s", _address(host, bound), " (TLS)" if tls else "")
    return GrpcServer(server=server, port=bound, health=health, _watch=watch)
