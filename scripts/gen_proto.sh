#!/usr/bin/env bash
# Regenerate the gRPC stubs from cache_service/proto/r3_cache.proto (needs grpcio-tools).
# The generated files are committed; tests/service/test_proto.py fails if they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-cache_service/proto}"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I cache_service/proto \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  cache_service/proto/r3_cache.proto
# protoc emits a top-level import; make it package-relative.
sed -i 's/^import r3_cache_pb2 as r3__cache__pb2$/from cache_service.proto import r3_cache_pb2 as r3__cache__pb2/' \
  "$out/r3_cache_pb2_grpc.py"
