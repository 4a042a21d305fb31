#!/usr/bin/env bash
# On the H200 (device tool): the fused Triton kernels of llmjp_ds/model/kernels (issue #33): their GPU tests,
# their bandwidth against the paths they replace, and `llmjp-ds bench` at llmjp3-1.8b with each one on and off.
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh check      # the kernels' tests and bandwidth
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh final-a    # + ours with both against the peers
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh final-b    # each off in turn, peer op fuser, profile
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh rope rope-profile   # the RoPE kernel alone
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh step-a   # GPU tests, bandwidth, 1.8B vs the peers
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh step-b   # the 172B slice and stage vs the peers
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh step-c   # the flip and resume, 1.8B FP8 again
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh hostbound   # where the GPU waits for the host
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh attn-a   # GPU tests, 1.8B with each attention core
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh attn-b   # the slice with each core, stage, profile
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh resid-a  # GPU tests, 1.8B with the residual fusion
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh resid-b  # the stage and slice with it; the flip
#   source .whl/env.sh && bash benchmarks/device/h200_kernels.sh flip     # the flip and a resume alone
# (run Z of docs/performance.md: final-a, then final-b; run AA: step-a, step-b, step-c)
# The GPU's clocks, power and throttle reasons are logged every half second to $OUT/gpu-clocks.csv.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TORCH_EXTENSIONS_DIR=/tmp/torch_ext TRITON_CACHE_DIR=/tmp/triton
S="$OUT/summary.md"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 500 > "$OUT/gpu-clocks.csv" 2>&1 &
SMI=$!; trap 'kill $SMI 2>/dev/null' EXIT
left() { echo $(( DEADLINE - $(date +%s) )); }
bench() { local name=$1; shift
  if (( $(left) < 40 )); then echo "=== $name skipped (time)" | tee -a "$S"; return; fi
  echo "=== $name ($(date +%T)): llmjp-ds bench $*" | tee -a "$S"
  timeout "$(left)" python -m llmjp_ds.cli bench "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$S"; grep -E "^\||^profile|^host|^GPU" "$OUT/$name.log" >> "$S"
  python -c "import json, sys; [print('step times', r['variant'], r['sets'], [round(t, 4) for t in r['step_times_s']])
             for r in json.load(open(sys.argv[1]))]" "$OUT/$name.json" >> "$S" 2>&1; }
tests() { local name=$1; shift
  echo "=== $name ($(date +%T)): pytest -m gpu $*" | tee -a "$S"
  timeout "${TESTS_S:-240}" python -m pytest -m gpu -q -s -p no:cacheprovider "$@" > "$OUT/$name.txt" 2>&1
  echo "rc=$?" >> "$S"; grep -E "^\[|passed|failed|Error" "$OUT/$name.txt" | tail -40 >> "$S"; }
bandwidth() {
  echo "=== bandwidth ($(date +%T)): python benchmarks/device/kernel_bandwidth.py --kernels $1" | tee -a "$S"
  timeout 180 python benchmarks/device/kernel_bandwidth.py --kernels "$1" --json "$OUT/bandwidth.json" \
    > "$OUT/bandwidth.log" 2>&1
  echo "rc=$?" >> "$S"; grep -E "^\||Error" "$OUT/bandwidth.log" >> "$S"; }
host_overhead() {  # each part of a decoder layer's host and GPU time per call
  echo "=== host overhead ($(date +%T)): python benchmarks/device/host_overhead.py" | tee -a "$S"
  timeout 240 python benchmarks/device/host_overhead.py > "$OUT/host-overhead.txt" 2>&1
  echo "rc=$?" >> "$S"; grep -E "^\||Error" "$OUT/host-overhead.txt" >> "$S"; }
flip() {  # the 1.8B's layer shape, 2 layers: BF16 -> FP8 delayed at step 6 (calibrated on 4-5), 14 steps
  # uninterrupted, against 10 steps with a checkpoint and a resume to 14; every kernel at its default
  if (( $(left) < 150 )); then echo "=== flip skipped (time)" | tee -a "$S"; return; fi
  echo "=== flip ($(date +%T)): 14 steps uninterrupted vs 10 + resume to 14" | tee -a "$S"
  local common=(--preset llmjp3-1.8b --set logging.wandb=disabled --set train.global_batch_size=8
    --set train.micro_batch_size=2 --set optim.warmup_steps=2 --set optim.decay_steps=14 --set train.eval_interval=0
    --set model.backend=te --set model.overrides.num_layers=2 --set precision.log_amax=true
    --set "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 6, recipe: delayed, fp8_format: hybrid, amax_history_len: 16, calibration_steps: 2}]")
  rm -rf /tmp/flip-a /tmp/flip-b
  timeout 200 python -m llmjp_ds.train "${common[@]}" --set run_dir=/tmp/flip-a --set train.steps=14 \
    --set checkpoint.interval=0 --set checkpoint.save_at_end=false > "$OUT/flip-a.log" 2>&1; echo "flip-a rc=$?" >> "$S"
  timeout 150 python -m llmjp_ds.train "${common[@]}" --set run_dir=/tmp/flip-b --set train.steps=10 \
    --set checkpoint.interval=10 > "$OUT/flip-b.log" 2>&1; echo "flip-b rc=$?" >> "$S"
  timeout 150 python -m llmjp_ds.train "${common[@]}" --set run_dir=/tmp/flip-b --set train.steps=14 \
    --set checkpoint.save_at_end=false >> "$OUT/flip-b.log" 2>&1; echo "flip-b resumed rc=$?" >> "$S"
  cp /tmp/flip-a/metrics.jsonl "$OUT/flip-a-metrics.jsonl"; cp /tmp/flip-b/metrics.jsonl "$OUT/flip-b-metrics.jsonl"
  python benchmarks/device/resume_summary.py /tmp/flip-a /tmp/flip-b 2>&1 | tee -a "$S"; }
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
  step-a)  # every GPU test; the kernels' bandwidth; 1.8B ours against the peers at their best; the fused step off
    TESTS_S=200 tests gpu-tests tests
    bandwidth rope,loss,adamw
    bench 1.8b-all "${B[@]}" --variants ours-bf16,ours-fp8-delayed,peer-mcore-bf16,peer-mcore-fp8-param
    bench 1.8b-step-off "${B[@]}" --variants ours-bf16,ours-fp8-delayed --set optim.fused_step=false ;;
  step-b)  # the 172B slice and TP4 stage against the peers, the fused step off at the slice
    bench slice-all --shapes 172b-slice --steps 3 --warmup 2 \
      --variants ours-bf16,ours-fp8-delayed,peer-mcore-bf16,peer-mcore-fp8-param
    bench slice-step-off --shapes 172b-slice --steps 3 --warmup 2 --variants ours-bf16,ours-fp8-delayed \
      --set optim.fused_step=false
    bench stage --shapes 172b-tp4-stage --steps 3 --warmup 2 ;;
  hostbound)  # where the GPU waits for the host: each part of a layer's host time, and the 1.8B step's gaps
    host_overhead
    bench 1.8b-gaps --shapes llmjp3-1.8b --steps 2 --warmup 2 --profile \
      --variants ours-bf16,ours-fp8-delayed,peer-mcore-bf16,peer-mcore-fp8-param ;;
  attn-a)  # model.attention_core: the GPU tests, each part's host time, the 1.8B with each core against the peers
    tests gpu-tests tests
    host_overhead
    bench 1.8b-all --shapes llmjp3-1.8b --steps 6 --warmup 2 \
      --variants ours-bf16,peer-mcore-bf16,ours-fp8-delayed,peer-mcore-fp8-param --set model.attention_core=cudnn
    bench 1.8b-core-te --shapes llmjp3-1.8b --steps 6 --warmup 2 --variants ours-bf16,ours-fp8-delayed \
      --set model.attention_core=te
    bench 1.8b-fp8-profile --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-fp8-delayed --profile ;;
  attn-b)  # the 172B slice with each attention core against the peers, the stage, the 1.8B BF16 profile
    bench slice-all --shapes 172b-slice --steps 3 --warmup 2 \
      --variants ours-bf16,peer-mcore-bf16,ours-fp8-delayed,peer-mcore-fp8-param --set model.attention_core=cudnn
    bench slice-core-te --shapes 172b-slice --steps 3 --warmup 2 --variants ours-bf16,ours-fp8-delayed \
      --set model.attention_core=te
    bench stage --shapes 172b-tp4-stage --steps 3 --warmup 2 --set model.attention_core=cudnn
    bench 1.8b-bf16-profile --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-bf16 --profile \
      --set model.attention_core=cudnn ;;
  step-c)  # the flip and a resume with every kernel on; the 1.8B FP8 step with the fused step on, off, on; profile
    flip
    bench 1.8b-fp8-on --shapes llmjp3-1.8b --steps 6 --warmup 2 --variants ours-fp8-delayed
    bench 1.8b-fp8-off --shapes llmjp3-1.8b --steps 6 --warmup 2 --variants ours-fp8-delayed --set optim.fused_step=false
    bench 1.8b-fp8-on-again --shapes llmjp3-1.8b --steps 6 --warmup 2 --variants ours-fp8-delayed
    bench 1.8b-fp8-profile --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-fp8-delayed --profile ;;
  resid-a)  # model.fused_residual_norm: every GPU test; 1.8B against the peers, the fusion off between two ons
    tests gpu-tests tests
    bench 1.8b-all --shapes llmjp3-1.8b --steps 6 --warmup 2 \
      --variants ours-bf16,peer-mcore-bf16,ours-fp8-delayed,peer-mcore-fp8-param
    bench 1.8b-resid-off --shapes llmjp3-1.8b --steps 6 --warmup 2 --variants ours-bf16,ours-fp8-delayed \
      --set model.fused_residual_norm=false
    bench 1.8b-resid-on --shapes llmjp3-1.8b --steps 6 --warmup 2 --variants ours-bf16,ours-fp8-delayed
    bench 1.8b-bf16-profile --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-bf16 --profile ;;
  resid-b)  # the stage with the fusion on and off, the slice against the peers, the flip and a resume with it
    bench stage --shapes 172b-tp4-stage --steps 3 --warmup 2
    bench stage-resid-off --shapes 172b-tp4-stage --steps 3 --warmup 2 --variants ours-bf16,ours-fp8-delayed \
      --set model.fused_residual_norm=false
    bench slice-all --shapes 172b-slice --steps 3 --warmup 2 \
      --variants ours-bf16,peer-mcore-bf16,ours-fp8-delayed,peer-mcore-fp8-param
    flip ;;
  flip) flip ;;  # the flip and a resume alone
  *) echo "unknown mode $mode" | tee -a "$S" ;;
esac
done
cat "$S"
