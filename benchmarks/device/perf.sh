#!/usr/bin/env bash
# On the H200 (device tool): `llmjp-ds bench` runs for docs/performance.md, each bench call under the time left.
#   source .whl/env.sh && bash benchmarks/device/perf.sh slice       # 172b-slice (profiled) and llmjp3-1.8b
#   source .whl/env.sh && bash benchmarks/device/perf.sh small       # llmjp3-3.7b, and the block recipe
#   source .whl/env.sh && bash benchmarks/device/perf.sh ablations   # one optimisation off at a time
#   source .whl/env.sh && bash benchmarks/device/perf.sh main-grad   # this build, profiled; DeepSpeed's timer on
#   source .whl/env.sh && bash benchmarks/device/perf.sh release     # the table of docs/performance.md
#   source .whl/env.sh && bash benchmarks/device/perf.sh syncs       # host synchronisations per step (1.8B)
#   source .whl/env.sh && bash benchmarks/device/perf.sh mcore       # ours against Megatron-Core, both shapes
#   source .whl/env.sh && bash benchmarks/device/perf.sh stage       # 172b-tp4-stage against te.TransformerLayer
#   source .whl/env.sh && bash benchmarks/device/perf.sh qkv-rope    # the fused QKV split + RoPE, on and off
#   source .whl/env.sh && bash benchmarks/device/perf.sh mcore-slice stage   # several modes, in order
# Ablations: DeepSpeed's fp32 accumulation after backward instead of in the grad hook, the eager loss, no FP8
# weight cache; `slice` also runs the step without the fused gradient accumulation.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
bench() { local name=$1; shift; local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 30 )); then echo "=== $name skipped (time)" | tee -a "$OUT/summary.md"; return; fi
  echo "=== $name ($(date +%T)): llmjp-ds bench $*" | tee -a "$OUT/summary.md"
  timeout "$left" python -m llmjp_ds.cli bench "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$OUT/summary.md"; grep -E "^\||^profile|^host" "$OUT/$name.log" >> "$OUT/summary.md"; }
for mode in "${@:-slice}"; do
case $mode in
  slice)  # the shape of the targets, profiled, and the 1.8B main variants
    bench slice --shapes 172b-slice --steps 3 --warmup 2 --profile \
      --variants ours-bf16,ours-fp8-delayed,ours-fp8-current,peer-bf16
    bench slice-unfused-accumulation --shapes 172b-slice --steps 3 --warmup 2 \
      --variants ours-bf16,ours-fp8-delayed --set parallel.fused_grad_accumulation=false
    bench 1.8b --shapes llmjp3-1.8b --steps 4 --warmup 2 --variants ours-bf16,peer-bf16,ours-fp8-delayed,ours-fp8-current ;;
  small)  # llmjp3-3.7b, the block recipe, and where the 1.8B step's time goes
    bench 3.7b --shapes llmjp3-3.7b --steps 4 --warmup 2 --variants ours-bf16,peer-bf16,ours-fp8-delayed,ours-fp8-current
    bench block --shapes 172b-slice,llmjp3-1.8b --steps 3 --warmup 2 --variants ours-fp8-block
    bench 1.8b-profile --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-bf16,ours-fp8-delayed --profile ;;
  host)  # where the 1.8B step's host time goes (cProfile beside the kernel profile)
    bench 1.8b-host --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-fp8-delayed,ours-bf16 --profile ;;
  final)  # the shipped ds_configs (fp32 gradient all-reduce) at the target shape
    bench final --shapes 172b-slice --steps 3 --warmup 2 --variants ours-bf16,ours-fp8-delayed ;;
  main-grad)  # embedding/head gradients into main_grad, no per-micro-batch sync; DeepSpeed's synchronising timer
    bench slice --shapes 172b-slice --steps 3 --warmup 2 --profile --variants ours-bf16,ours-fp8-delayed
    bench 1.8b --shapes llmjp3-1.8b --steps 3 --warmup 2 --profile --variants ours-bf16,ours-fp8-delayed,peer-bf16
    bench 1.8b-timer --shapes llmjp3-1.8b --steps 3 --warmup 2 --variants ours-bf16,ours-fp8-delayed \
      --set parallel.ds_config=benchmarks/ds_configs/zero1-throughput-timer.json
    python -m pytest -q -m gpu tests/model/test_main_grad.py 2>&1 | tail -3 >> "$OUT/summary.md" ;;
  release)  # every main variant side by side per shape, then the FP8 LM head option, then llmjp3-3.7b
    bench slice --shapes 172b-slice --steps 4 --warmup 2 \
      --variants ours-bf16,ours-fp8-delayed,ours-fp8-current,peer-bf16
    bench 1.8b --shapes llmjp3-1.8b --steps 4 --warmup 2 --variants ours-bf16,peer-bf16,ours-fp8-delayed,ours-fp8-current
    bench fp8-head --shapes 172b-slice,llmjp3-1.8b --steps 4 --warmup 2 --variants ours-fp8-delayed \
      --set precision.fp8_lm_head=true
    bench 3.7b --shapes llmjp3-3.7b --steps 3 --warmup 2 --variants ours-bf16,peer-bf16,ours-fp8-delayed ;;
  release-rest)  # llmjp3-3.7b, and where the FP8-head step's time goes
    bench 3.7b --shapes llmjp3-3.7b --steps 3 --warmup 2 --variants ours-bf16,peer-bf16,ours-fp8-delayed
    bench fp8-head-profile --shapes 172b-slice --steps 2 --warmup 2 --variants ours-fp8-delayed \
      --set precision.fp8_lm_head=true --profile ;;
  syncs)  # where the host waits for the GPU in a step (sync debug mode), beside the kernel and host profiles
    python -m pytest -q -m gpu tests/model/test_main_grad.py tests/test_bench.py 2>&1 | tail -3 >> "$OUT/summary.md"
    bench 1.8b-syncs --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-fp8-delayed,ours-bf16 --profile ;;
  ablations)  # one optimisation off at a time
    S=(--shapes 172b-slice --steps 3 --warmup 2)
    bench slice-accumulate-after-backward "${S[@]}" --variants ours-bf16 \
      --set parallel.ds_config=benchmarks/ds_configs/zero1-accumulate-after-backward.json
    bench slice-eager-loss "${S[@]}" --variants ours-bf16 --set model.fused_loss=false
    bench slice-no-weight-cache "${S[@]}" --variants ours-fp8-delayed --set precision.fp8_weight_cache=false ;;
  mcore)  # the Megatron-Core peer's table: both whole-model shapes, the default variants, one call
    bench mcore --shapes 172b-slice,llmjp3-1.8b --steps 3 --warmup 2 ;;
  mcore-1.8b)  # the same at one shape (half the time)
    bench mcore-1.8b --shapes llmjp3-1.8b --steps 3 --warmup 2 ;;
  mcore-slice)
    bench mcore-slice --shapes 172b-slice --steps 3 --warmup 2 ;;
  qkv-rope)  # the fused QKV split + RoPE (model.fused_qkv_rope): its GPU test, then on and off at 1.8B
    python -m pytest -q -m gpu -p no:cacheprovider -s tests/model/test_backends.py -k fused_qkv_rope 2>&1 \
      | grep -E "fused qkv rope|passed|failed|Error" | tee -a "$OUT/summary.md"
    bench 1.8b-fused --shapes llmjp3-1.8b --steps 3 --warmup 2 --variants ours-bf16,ours-fp8-delayed
    bench 1.8b-unfused --shapes llmjp3-1.8b --steps 3 --warmup 2 --variants ours-bf16,ours-fp8-delayed \
      --set model.fused_qkv_rope=false ;;
  stage)  # one GPU's share of a 172B TP4 x PP16 middle stage: our full step against te.TransformerLayer fwd + bwd
    bench stage --shapes 172b-tp4-stage --steps 3 --warmup 2 ;;
  profile-1.8b)  # where the 1.8B step's time goes, kernels and host, in this build
    bench 1.8b-profile --shapes llmjp3-1.8b --steps 2 --warmup 2 --variants ours-bf16,ours-fp8-delayed --profile ;;
  *) echo "unknown perf.sh mode $mode" | tee -a "$OUT/summary.md" ;;
esac
done
cat "$OUT/summary.md"
