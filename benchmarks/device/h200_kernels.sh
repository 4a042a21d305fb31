#!/usr/bin/env bash
# On the H200 (device tool): the fused Triton kernels of llmjp_ds/model/kernels (issue #33): their GPU tests,
# their bandwidth against the paths they replace, and `llmjp-ds bench` at llmjp3-1.8b with each one on and off.
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh check      # the kernels' tests and bandwidth
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh final-a    # + ours with both against the peers
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh final-b    # each off in turn, peer op fuser, profile
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh rope rope-profile   # the RoPE kernel alone
# (run Z of docs/performance.md: final-a, then final-b)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TORCH_EXTENSIONS_DIR=/tmp/torch_ext TRITON_CACHE_DIR=/tmp/triton
S="$OUT/summary.md"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
left() { echo $(( DEADLINE - $(date +%s) )); }
bench() { local name=$1; shift
  if (( $(left) < 40 )); then echo "=== $name skipped (time)" | tee -a "$S"; return; fi
  echo "=== $name ($(date +%T)): llmjp-ds bench $*" | tee -a "$S"
  timeout "$(left)" python -m llmjp_ds.cli bench "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$S"; grep -E "^\||^profile|^host" "$OUT/$name.log" >> "$S"; }
tests() { local name=$1; shift
  echo "=== $name ($(date +%T)): pytest -m gpu $*" | tee -a "$S"
  timeout "${TESTS_S:-240}" python -m pytest -m gpu -q -s -p no:cacheprovider "$@" > "$OUT/$name.txt" 2>&1
  echo "rc=$?" >> "$S"; grep -E "^\[|passed|failed|Error" "$OUT/$name.txt" | tail -40 >> "$S"; }
bandwidth() {
  echo "=== bandwidth ($(date +%T)): python benchmarks/device/kernel_bandwidth.py --kernels $1" | tee -a "$S"
  timeout 180 python benchmarks/device/kernel_bandwidth.py --kernels "$1" --json "$OUT/bandwidth.json" \
    > "$OUT/bandwidth.log" 2>&1
  echo "rc=$?" >> "$S"; grep -E "^\||Error" "$OUT/bandwidth.log" >> "$S"; }
B=(--shapes llmjp3-1.8b --steps 3 --warmup 2)
for mode in "$@"; do
case $mode in
  rope)
    tests rope-tests tests/model/test_kernel_rope.py tests/model/test_backends.py -k "rope"
    bandwidth rope
    bench 1.8b-rope-te "${B[@]}" --variants ours-bf16,ours-fp8-delayed --set model.fused_qkv_rope=te
    bench 1.8b-rope-triton "${B[@]}" --variants ours-bf16,ours-fp8-delayed --set model.fused_qkv_rope=triton ;;
  rope-profile)  # the in-place RoPE's bandwidth, and where the 1.8B BF16 step's time goes with it
    tests rope-tests tests/model/test_kernel_rope.py
    bandwidth rope
    bench 1.8b-rope-profile --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-bf16 --profile \
      --set model.fused_qkv_rope=triton ;;
  check)  # the kernels' GPU tests and bandwidth
    tests kernel-tests tests/model/test_kernel_rope.py tests/model/test_kernel_cross_entropy.py
    bandwidth rope,loss ;;
  final-a)  # the kernels' tests and bandwidth; ours with both kernels against Megatron-Core at its defaults
    tests kernel-tests tests/model/test_kernel_rope.py tests/model/test_kernel_cross_entropy.py
    bandwidth rope,loss
    LLMJP_DS_FUSED_LOSS=triton bench 1.8b-kernels "${B[@]}" --set model.fused_qkv_rope=triton ;;
  final-b)  # each kernel off in turn, both off, Megatron-Core with TE's op fuser, the BF16 step profiled
    LLMJP_DS_FUSED_LOSS=triton bench 1.8b-rope-te "${B[@]}" --variants ours-bf16,ours-fp8-delayed \
      --set model.fused_qkv_rope=te
    LLMJP_DS_FUSED_LOSS=compiled bench 1.8b-loss-compiled "${B[@]}" --variants ours-bf16,ours-fp8-delayed \
      --set model.fused_qkv_rope=triton
    LLMJP_DS_FUSED_LOSS=compiled bench 1.8b-both-off "${B[@]}" --variants ours-bf16,ours-fp8-delayed \
      --set model.fused_qkv_rope=te
    bench 1.8b-mcore-op-fuser "${B[@]}" --variants peer-mcore-bf16,peer-mcore-fp8-param \
      --peer-set use_transformer_engine_op_fuser=true
    LLMJP_DS_FUSED_LOSS=triton bench 1.8b-profile --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-bf16 \
      --profile --set model.fused_qkv_rope=triton ;;
  *) echo "unknown mode $mode" | tee -a "$S" ;;
esac
done
cat "$S"
