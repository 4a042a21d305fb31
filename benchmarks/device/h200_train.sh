#!/usr/bin/env bash
# On the H200 (device tool): the llmjp3-1.8b preset with the TE backend under ZeRO-1 BF16, 50 steps in two
# invocations (0->25 with a checkpoint, resumed 25->50), and the BF16 -> FP8 flip at step 30 for each recipe,
# every fork resumed from the same step-25 BF16 checkpoint (hard links: a 1.8B checkpoint with its optimizer
# state is 26 GB, the disk holds 64, and writing one takes most of a minute). Delayed scaling calibrates on
# steps 28-29, is checkpointed after the flip (40), resumed to 50, and that FP8-phase checkpoint is exported
# with the reload parity check, as is the BF16 one.
#   source .whl/env.sh && bash benchmarks/device/h200_train.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LLMJP_DS_CACHE=$PWD/.cache TORCH_EXTENSIONS_DIR=/tmp/torch_ext
R=/tmp/runs; mkdir -p $R
S="$OUT/summary.txt"
log() { echo "=== $* ($(date +%T), disk free $(df -h --output=avail /tmp | tail -1))" | tee -a "$S"; }
COMMON=(--preset llmjp3-1.8b --set logging.wandb=disabled --set train.global_batch_size=8
        --set train.micro_batch_size=2 --set optim.warmup_steps=10 --set optim.decay_steps=50
        --set checkpoint.interval=0 --set checkpoint.keep_last=1 --set train.eval_interval=0 --set model.backend=te)
# a dry run of the same flow on a CPU: EXTRA="--set model.backend=torch --set precision.emulate_fp8=true ..."
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"; COMMON+=("${EXTRA_ARGS[@]}")
train() { local t=$1 log=$2; shift 2; timeout "$t" python -m llmjp_ds.train "${COMMON[@]}" "$@" >> "$OUT/$log.log" 2>&1
          echo "$log rc=$?" | tee -a "$S"; grep -E "^step [0-9]+/|^error" "$OUT/$log.log" | tail -3 | tee -a "$S"; }
fork() { mkdir -p $R/$1/checkpoints && cp -al $R/base/checkpoints/step00000025 $R/$1/checkpoints/ \
         && echo step00000025 > $R/$1/checkpoints/latest && cp -r $R/base/tokenizer $R/base/metrics.jsonl $R/$1/; }
phases() { echo "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 30, recipe: $1, fp8_format: hybrid, amax_history_len: 16, calibration_steps: 2}]"; }

log "1.8B BF16 steps 0-25 (checkpoint at 25)"
train 200 base --set run_dir=$R/base --set train.steps=25
log "export the step-25 BF16 checkpoint (in the background, on the CPUs)"
(timeout 200 python -m llmjp_ds.cli export --run $R/base --output /tmp/hf_base --dtype bf16 --force > "$OUT/export_base.log" 2>&1) &
for recipe in current block; do
  log "fork: FP8 $recipe from step 30, steps 25-40"
  fork $recipe; train 150 $recipe --set run_dir=$R/$recipe --set train.steps=40 --set "$(phases $recipe)" \
    --set precision.log_amax=true --set checkpoint.save_at_end=false
done
log "fork: BF16 resumed from the step-25 checkpoint, 25-50"
fork bf16; train 200 bf16 --set run_dir=$R/bf16 --set train.steps=50 --set checkpoint.save_at_end=false
wait; tail -1 "$OUT/export_base.log" | tee -a "$S"
rm -rf /tmp/hf_base $R/current/checkpoints $R/block/checkpoints $R/bf16/checkpoints
log "fork: FP8 delayed from step 30, steps 25-40 (checkpoint after the flip)"
mkdir -p $R/delayed && mv $R/base/checkpoints $R/delayed/ && cp -r $R/base/tokenizer $R/base/metrics.jsonl $R/delayed/
train 150 delayed --set run_dir=$R/delayed --set train.steps=40 --set "$(phases delayed)" --set precision.log_amax=true
log "FP8 delayed resumed after the flip, 40-50"
train 150 delayed --set run_dir=$R/delayed --set train.steps=50 --set "$(phases delayed)" --set precision.log_amax=true \
  --set checkpoint.save_at_end=false
log "export the FP8-phase checkpoint (step 40)"
timeout 150 python -m llmjp_ds.cli export --run $R/delayed --output /tmp/hf_delayed --dtype bf16 --force 2>&1 | tail -1 | tee -a "$S"
log "flip summary"
python benchmarks/device/flip_summary.py $R/bf16 $R/delayed $R/current $R/block 2>&1 | tee -a "$S"
tar czf "$OUT/metrics.tgz" -C $R base/metrics.jsonl bf16/metrics.jsonl delayed/metrics.jsonl current/metrics.jsonl block/metrics.jsonl
