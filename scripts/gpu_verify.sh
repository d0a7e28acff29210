#!/usr/bin/env bash
# Verification's figures on a machine with an NVIDIA GPU and many cores (issue 20): how far
# the same gradient and the same local SGD inner steps land on the CPU and on the GPU
# (scripts/measure_device_tolerance.py, the verification tolerances are 20 x these), then
# scripts/bench_verify.py in local SGD mode on the machine's CPU cores.
#
# Usage: scripts/gpu_verify.sh [OUT_DIR] [bench_verify.py arguments...]
# Writes tolerance.json, tolerance_local.json, bench_local_sgd.json and bench.log to OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/epochmesh-gpu-verify}}
mkdir -p "$out"
# shellcheck source=scripts/_device_python.sh
source scripts/_device_python.sh "$out"
export PYTHONUNBUFFERED=1
"$py" scripts/measure_device_tolerance.py --batch 64 --batches 4 --out "$out/tolerance.json" \
    >/dev/null
"$py" scripts/measure_device_tolerance.py --local-steps 16 --batch 64 --batches 4 \
    --out "$out/tolerance_local.json" >/dev/null
"$py" scripts/bench_verify.py --mode local_sgd "${@:2}" >"$out/bench_local_sgd.json" \
    2>"$out/bench.log" || { tail -30 "$out/bench.log" >&2; exit 1; }
cat "$out/tolerance_local.json" "$out/bench_local_sgd.json"
