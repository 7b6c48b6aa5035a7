#!/usr/bin/env bash
# Regenerate r3_cache.proto's record messages and the gRPC stubs (needs grpcio-tools).
# The generated files are committed; tests/service/test_proto.py fails if they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-clients/r3_client/_proto}"
# The record messages come from the dataclasses (r3_client/_answer_forms.py): rewritten in
# place, or with an output directory given (tests/client/test_proto.py) only checked.
if [ $# -eq 0 ]; then
  "${PYTHON:-.venv/bin/python}" scripts/gen_proto.py
else
  "${PYTHON:-.venv/bin/python}" scripts/gen_proto.py --check
fi
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I clients/r3_client/_proto \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  clients/r3_client/_proto/r3_cache.proto
# protoc emits a top-level import; make it package-relative.
sed -i 's/^import r3_cache_pb2 as r3__cache__pb2$/from r3_client._proto import r3_cache_pb2 as r3__cache__pb2/' \
  "$out/r3_cache_pb2_grpc.py"
