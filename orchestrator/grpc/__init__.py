"""kvyard's gRPC endpoint: the KServe v2 / Open Inference Protocol `inference.GRPCInferenceService`
(Triton's LLM tensor convention, ModelStreamInfer included), grpc.health.v1 and server reflection.

    server = await start_grpc_server(service, pool, port=8001, host="127.0.0.1")
    ...
    await server.stop()

The .proto lives in orchestrator/protos/; the stubs in generated/ come from scripts/gen_protos.sh.
"""

from orchestrator.grpc.server import GrpcServer, GrpcStartError, start_grpc_server
from orchestrator.grpc.servicer import MODEL_VERSION, SERVICE_NAME, InferenceServicer

__all__ = ["start_grpc_server", "GrpcServer", "GrpcStartError", "InferenceServicer", "SERVICE_NAME", "MODEL_VERSION"]
