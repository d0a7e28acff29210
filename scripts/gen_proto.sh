#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf stubs under epochmesh/v1 from proto/epochmesh/v1.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (OUT_DIR defaults to the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out/epochmesh/v1"
"$py" -m grpc_tools.protoc -Iproto \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/epochmesh/v1/*.proto
