#!/usr/bin/env bash
# On the H200: the GPU tests of this build, then perf.sh's modes (default: the Megatron-Core peer at the 172B
# layer shape).
#   source .whl/env.sh && bash benchmarks/device/h200_gpu_tests.sh [perf.sh mode ...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
timeout 240 python -m pytest -m gpu tests -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
BUDGET_S=${BUDGET_S:-320} bash benchmarks/device/perf.sh "${@:-mcore-slice}"
