#!/usr/bin/env bash
# Prove the CUDA path on a machine with an NVIDIA GPU: device discovery, the agents' benchmark on
# cuda:0, a two-agent job sharing the GPU with the replay check, peak GPU memory, samples/s
# against the CPU (scripts/gpu_check.py says what each step does). One JSON line on stdout.
#
# Usage:
#   scripts/gpu_check.sh [OUT_DIR]      run the check (OUT_DIR: logs and gpu_check.json)
#   scripts/gpu_check.sh wheels         download the pinned wheels (constraints.txt) that a
#                                       machine without a package index needs into .whl/
#
# Where .venv exists (scripts/test.sh made it) the check runs in it. Elsewhere (a GPU machine
# whose python3 holds a CUDA build of torch, and no network) the project and the wheels in
# .whl/ are installed into that python3 without an index; torch stays the machine's own.
set -euo pipefail
cd "$(dirname "$0")/.."

pinned() { grep -E "^$1==" constraints.txt | head -1; }

if [[ "${1:-}" == "wheels" ]]; then
    pyver=${PYVER:-3.12}
    mkdir -p .whl
    for name in grpcio grpcio-health-checking grpcio-reflection protobuf aiosqlite prometheus-client \
        cryptography cffi pycparser blake3; do
        spec=$(pinned "$name") || spec=$name
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
            --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$spec"
    done
    ls .whl
    exit 0
fi

out=${1:-${OUT:-/tmp/epochmesh-gpu-check}}
mkdir -p "$out"
# shellcheck source=scripts/_device_python.sh
source scripts/_device_python.sh "$out"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
fi
"$py" -c 'import sys, torch, grpc, google.protobuf as pb
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "grpc", grpc.__version__, "protobuf", pb.__version__,
      file=sys.stderr)'
rc=0
PYTHONUNBUFFERED=1 "$py" scripts/gpu_check.py --out "$out/logs" "${@:2}" || rc=$?
cp "$out/logs/gpu_check.json" "$out/" 2>/dev/null || true
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
exit $rc
