"""Stubs generated from orchestrator/protos/grpc_service.proto; regenerate with `bash scripts/gen_protos.sh`.

The messages live in a private descriptor pool (`POOL`), not protobuf's default pool, so that other
copies of the `inference` protocol in the same process (tritonclient, KServe) do not collide.
"""

from orchestrator.grpc.generated import grpc_service_pb2 as pb
from orchestrator.grpc.generated import grpc_service_pb2_grpc as pb_grpc

POOL = pb.DESCRIPTOR.pool

__all__ = ["pb", "pb_grpc", "POOL"]
