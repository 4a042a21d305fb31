#!/usr/bin/env bash
# On the H200 (device tool): the model's GPU tests, then the llmjp3-1.8b preset trained with the TE backend under
# ZeRO-1 BF16 (50 steps, stopped at 30 and resumed), the BF16 -> FP8 flip with each recipe resumed from the
# BF16 run's step-20 checkpoint (flip at 30, delayed scaling calibrated on steps 28-29, stopped at 40 and
# resumed), and exports with their parity checks.
#   source .whl/env.sh && bash benchmarks/device/h200_train.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LLMJP_DS_CACHE=$PWD/.cache TORCH_EXTENSIONS_DIR=/tmp/torch_ext
R=/tmp/runs; mkdir -p $R
log() { echo "=== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
COMMON=(--preset llmjp3-1.8b --set logging.wandb=disabled --set train.global_batch_size=8
        --set train.micro_batch_size=2 --set optim.warmup_steps=10 --set optim.decay_steps=50
        --set checkpoint.interval=10 --set checkpoint.keep_last=10 --set train.eval_interval=0
        --set model.backend=te)
train() { python -m llmjp_ds.train "${COMMON[@]}" "$@"; }

log "model GPU tests"
timeout 240 python -m pytest -q -s -m gpu tests/model 2>&1 | grep -v "Writing model shards" | tee "$OUT/model_gpu_tests.txt" | tail -12

log "1.8B BF16: 30 steps, then resume to 50"
timeout 300 train --set run_dir=$R/bf16 --set train.steps=30 > "$OUT/train_bf16.log" 2>&1; echo "rc=$?" | tee -a "$OUT/summary.txt"
timeout 200 train --set run_dir=$R/bf16 --set train.steps=50 >> "$OUT/train_bf16.log" 2>&1; echo "rc=$?" | tee -a "$OUT/summary.txt"
grep -E "^step (1|10|20|30|31|40|50)/" "$OUT/train_bf16.log" | tee -a "$OUT/summary.txt"

for recipe in delayed current block; do
  log "1.8B flip to FP8 $recipe at step 30 (resumed from the BF16 step-20 checkpoint)"
  mkdir -p $R/$recipe/checkpoints && cp -r $R/bf16/checkpoints/step00000020 $R/$recipe/checkpoints/ \
    && echo step00000020 > $R/$recipe/checkpoints/latest && cp -r $R/bf16/tokenizer $R/$recipe/
  head -20 $R/bf16/metrics.jsonl > $R/$recipe/metrics.jsonl
  PH="precision.phases=[{precision: bf16}, {precision: fp8, start_step: 30, recipe: $recipe, fp8_format: hybrid, amax_history_len: 16, calibration_steps: 2}]"
  stop=50; [ $recipe = delayed ] && stop=40
  timeout 200 train --set run_dir=$R/$recipe --set train.steps=$stop --set "$PH" --set precision.log_amax=true > "$OUT/train_$recipe.log" 2>&1
  echo "rc=$?" | tee -a "$OUT/summary.txt"
  if [ $recipe = delayed ]; then
    timeout 150 train --set run_dir=$R/$recipe --set train.steps=50 --set "$PH" --set precision.log_amax=true >> "$OUT/train_$recipe.log" 2>&1
    echo "resume after flip rc=$?" | tee -a "$OUT/summary.txt"
  fi
  grep -E "^step (21|29|30|31|32|40|41|50)/|error|Error" "$OUT/train_$recipe.log" | head -12 | tee -a "$OUT/summary.txt"
done

log "flip summary"
python benchmarks/device/flip_summary.py $R/bf16 $R/delayed $R/current $R/block 2>&1 | tee -a "$OUT/summary.txt"

for run in bf16 delayed; do
  log "export $run"
  timeout 200 python -m llmjp_ds.cli export --run $R/$run --output /tmp/hf_$run --dtype bf16 --force 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
done
tar czf "$OUT/metrics.tgz" -C $R bf16/metrics.jsonl delayed/metrics.jsonl current/metrics.jsonl block/metrics.jsonl 2>/dev/null
