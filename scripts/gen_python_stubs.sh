#!/usr/bin/env bash
# Regenerates the Python client's protobuf and gRPC stubs (client/python/shardcast/v1/*_pb2*.py)
# from proto/ with Debian's protoc and grpc_python_plugin. The stubs are committed so that the
# package is pure Python; client/python/tests/test_stubs.py fails when they drift from proto/.
#   scripts/gen_python_stubs.sh [OUT_DIR]   (default: client/python)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/client/python}"
mkdir -p "$out/shardcast/v1"
protoc -I "$root/proto" \
  --python_out="$out" \
  --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" \
  "$root/proto/shardcast/v1/layout.proto" "$root/proto/shardcast/v1/service.proto"
