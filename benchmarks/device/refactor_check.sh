#!/usr/bin/env bash
# On the H200: this build against the previous build (a copy of its llmjp_ds/ and ds_configs/ in .cache/prev,
# carried to the device), `llmjp-ds bench` side by side in the same machine start, plus the GPU tests.
#   source .whl/env.sh && bash benchmarks/device/refactor_check.sh bench     # GPU tests, then bench prev/this
#   source .whl/env.sh && RUNS="full resumed" bash benchmarks/device/h200_perf_check.sh   # the trainer itself
# The previous build runs from .cache/prev as its working directory, so `python -m` imports its package.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
S="$OUT/summary.md"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
bench() { local name=$1 dir=$2; shift 2; local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 30 )); then echo "=== $name skipped (time)" | tee -a "$S"; return; fi
  echo "=== $name ($(date +%T), in $dir): llmjp-ds bench $*" | tee -a "$S"
  (cd "$dir" && timeout "$left" python -m llmjp_ds.cli bench "$@" --json "$OUT/$name.json") > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$S"; grep -E "^\|" "$OUT/$name.log" >> "$S"; }
case "${1:-bench}" in
  bench)
    timeout 200 python -m pytest -q -m gpu tests/model tests/test_bench.py > "$OUT/gpu-tests.log" 2>&1
    echo "gpu tests rc=$?: $(tail -1 "$OUT/gpu-tests.log")" | tee -a "$S"
    for shape in 172b-slice llmjp3-1.8b; do
      for build in prev this; do
        dir=$PWD; [[ $build == prev ]] && dir=$PWD/.cache/prev
        bench "$shape-$build" "$dir" --shapes "$shape" --steps 3 --warmup 2 --variants ours-bf16,ours-fp8-delayed
      done
    done ;;
esac
cat "$S"
