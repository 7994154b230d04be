#!/usr/bin/env bash
# Regenerate the committed gRPC stubs (orchestrator/grpc/generated/) from orchestrator/protos/*.proto.
#
#   bash scripts/gen_protos.sh            # uses .venv/bin/python (needs the dev extra: grpcio-tools)
#   PY=python3 bash scripts/gen_protos.sh
#   bash scripts/gen_protos.sh DIR        # write elsewhere (the drift test compares DIR with the committed stubs)
#
# protoc's output is post-processed in three ways:
#   * the messages are registered in a private descriptor pool instead of protobuf's default one, so
#     kvyard's `inference.*` messages never clash with another copy of the same protocol loaded in
#     the same process (tritonclient, the KServe SDK, ...); orchestrator.grpc.server serves
#     reflection from that pool;
#   * the service module imports its message module relatively (it lives inside a package);
#   * each module's docstring names this script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
SRC="$ROOT/orchestrator/protos"
OUT="${1:-$ROOT/orchestrator/grpc/generated}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

"$PY" -m grpc_tools.protoc -I "$SRC" --python_out="$TMP" --pyi_out="$TMP" --grpc_python_out="$TMP" "$SRC"/grpc_service.proto

DOC='"""Generated from orchestrator/protos/grpc_service.proto by `bash scripts/gen_protos.sh` (grpcio-tools); do not edit."""'
sed -i \
  -e "s|^\"\"\"Generated protocol buffer code.\"\"\"\$|$DOC|" \
  -e 's|_descriptor_pool\.Default()\.AddSerializedFile|_descriptor_pool.DescriptorPool().AddSerializedFile|' \
  "$TMP/grpc_service_pb2.py"
sed -i \
  -e "s|^\"\"\"Client and server classes corresponding to protobuf-defined services.\"\"\"\$|$DOC|" \
  -e 's|^import grpc_service_pb2 as grpc__service__pb2$|from . import grpc_service_pb2 as grpc__service__pb2|' \
  "$TMP/grpc_service_pb2_grpc.py"
grep -q 'DescriptorPool().AddSerializedFile' "$TMP/grpc_service_pb2.py" || { echo "gen_protos: pool rewrite failed" >&2; exit 1; }
grep -q '^from \. import grpc_service_pb2' "$TMP/grpc_service_pb2_grpc.py" || { echo "gen_protos: import rewrite failed" >&2; exit 1; }

mkdir -p "$OUT"
cp "$TMP"/grpc_service_pb2.py "$TMP"/grpc_service_pb2.pyi "$TMP"/grpc_service_pb2_grpc.py "$OUT"/
echo "regenerated 3 stub files in ${OUT#"$ROOT"/}"
