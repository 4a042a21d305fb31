#!/usr/bin/env bash
# On a machine of several H200s (device kind nvidia-h200-x2; NGPU = the GPUs it has): the trainer's parallel
# layouts against the one-GPU run of the same global batch, each through the BF16 -> FP8 delayed flip.
#   source .whl/env.sh && bash benchmarks/device/h200_multi.sh layouts|partition|scale|slice
# layouts: an 8-layer llmjp3-1.8b (seq 4096, global batch 16, micro-batch 2), 16 steps, FP8 from step 9
#   (calibrated on steps 7-8); one GPU, then NGPU GPUs as ZeRO-1, ZeRO-2 and ZeRO-3 data parallel and as
#   pipeline x data parallel (2 stages, ZeRO-1). The pipeline and ZeRO-3 runs checkpoint at step 12 (after the
#   flip); a fork of that checkpoint resumes 12 -> 16 on the same GPUs, and the checkpoint is exported (on the
#   CPUs, with the export's reload parity check) while the GPUs train.
# partition: 8- and 24-layer llmjp3-1.8b as 2 pipeline stages, cut by DeepSpeed's even split of decoder layers
#   (type:DecoderLayerPipe) and by training FLOPs (flops, the default: the head counts), against one GPU
#   (LAYERS="24" METHODS="flops" narrow it down).
# scale: the whole llmjp3-1.8b, global batch 32 (16 micro-batches per step): one GPU, ZeRO-1 data parallel and
#   two pipeline stages.
# slice: the 172B preset's layer shape, seq 4096, micro-batch 1, FP8 (LLM-jp's delayed hybrid, history 1) from
#   step 5: 2 layers on one GPU (global batch 8), then 4 layers (more than one GPU holds with its optimizer state)
#   as 2 pipeline stages (global batch 16).
# failures: an 8-layer llmjp3-1.8b on NGPU GPUs: wandb offline on an image without wandb (rank 0 fails after the
#   process group exists), a SIGKILL of rank 1 mid-step, each timed until the whole job has ended; then ZeRO-1
#   data parallel through the flip with a checkpoint at step 12, resumed from it on one GPU (a reshape) against
#   the uninterrupted run.
# A dry run on the CPUs: NGPU=2 EXTRA="--set model.backend=torch --set precision.emulate_fp8=true ..."
set -uo pipefail
MODE=${1:?usage: h200_multi.sh layouts|partition|scale|slice|failures}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
source benchmarks/device/lib.sh

FLIP=8
use_1_8b() {  # COMMON for llmjp3-1.8b with $1 layers, global batch ${2:-16}: 16 steps, FP8 from step FLIP + 1
  COMMON=(--preset llmjp3-1.8b --set "model.overrides={num_layers: $1}" --set model.backend=te
          --set logging.wandb=disabled --set train.global_batch_size=${2:-16} --set train.micro_batch_size=2
          --set train.steps=16 --set optim.warmup_steps=4 --set optim.decay_steps=16 --set train.eval_interval=0
          --set checkpoint.interval=0 --set checkpoint.keep_last=1 --set checkpoint.save_at_end=false
          --set precision.log_amax=true
          --set "precision.phases=[{precision: bf16}, {precision: fp8, start_step: $FLIP, recipe: delayed, fp8_format: hybrid, amax_history_len: 16, calibration_steps: 2}]")
}

if [ "$MODE" = layouts ]; then
  use_1_8b 8
  train single 1 150
  train "zero1-dp$NGPU" "$NGPU" 150 --set parallel.zero_stage=1
  train "zero2-dp$NGPU" "$NGPU" 150 --set parallel.zero_stage=2
  train "zero3-dp$NGPU" "$NGPU" 180 --set parallel.zero_stage=3 --set checkpoint.interval=12
  fork zero3-resumed "zero3-dp$NGPU" 12 && export_run zero3-resumed
  train "pp2-dp$((NGPU / 2))" "$NGPU" 180 --set parallel.pipeline_stages=2 --set checkpoint.interval=12
  train zero3-resumed "$NGPU" 150 --set parallel.zero_stage=3
  fork pp2-resumed "pp2-dp$((NGPU / 2))" 12 && export_run pp2-resumed
  train pp2-resumed "$NGPU" 150 --set parallel.pipeline_stages=2
  log "waiting for the exports"; wait
  python benchmarks/device/multi_summary.py $FLIP "$R/single" "$R/zero1-dp$NGPU:$NGPU" "$R/zero2-dp$NGPU:$NGPU" \
    "$R/zero3-dp$NGPU:$NGPU" "$R/pp2-dp$((NGPU / 2)):$NGPU" \
    --resumed "$R/zero3-dp$NGPU:$R/zero3-resumed:12" "$R/pp2-dp$((NGPU / 2)):$R/pp2-resumed:12" 2>&1 | tee -a "$S"
  tar czf "$OUT/metrics-$MODE.tgz" -C "$R" $(cd "$R" && ls -d */metrics.jsonl)
elif [ "$MODE" = partition ]; then
  # where the pipeline cuts: DeepSpeed's even split of decoder layers against the FLOP-balanced default
  for layers in ${LAYERS:-8 24}; do
    use_1_8b $layers
    train "single-${layers}l" 1 150
    for method in ${METHODS:-type:DecoderLayerPipe flops}; do
      train "pp2-${layers}l-${method#type:}" "$NGPU" 150 --set parallel.pipeline_stages=2 \
        --set parallel.partition_method=$method
    done
    python benchmarks/device/multi_summary.py $FLIP "$R/single-${layers}l" "$R/pp2-${layers}l-DecoderLayerPipe:$NGPU" \
      "$R/pp2-${layers}l-flops:$NGPU" 2>&1 | sed '/^loss per step/,$d' | tee -a "$S"
  done
  grep -h "pipeline stages by training FLOPs" "$OUT"/pp2-*-flops.log | sort -u | tee -a "$S"
  tar czf "$OUT/metrics-$MODE.tgz" -C "$R" $(cd "$R" && ls -d single-*/metrics.jsonl pp2-*/metrics.jsonl)
elif [ "$MODE" = scale ]; then
  # the whole llmjp3-1.8b with 16 micro-batches of 2 per step: data parallel and pipeline against one GPU
  use_1_8b 24 32
  train single-24l-gbs32 1 200
  train "zero1-dp$NGPU-24l-gbs32" "$NGPU" 200 --set parallel.zero_stage=1
  train "pp2-dp$((NGPU / 2))-24l-gbs32" "$NGPU" 200 --set parallel.pipeline_stages=2
  python benchmarks/device/multi_summary.py $FLIP "$R/single-24l-gbs32" "$R/zero1-dp$NGPU-24l-gbs32:$NGPU" \
    "$R/pp2-dp$((NGPU / 2))-24l-gbs32:$NGPU" 2>&1 | sed '/^loss per step/,$d' | tee -a "$S"
  tar czf "$OUT/metrics-$MODE.tgz" -C "$R" $(cd "$R" && ls -d *-gbs32/metrics.jsonl)
elif [ "$MODE" = failures ]; then
  use_1_8b 8
  t0=$SECONDS; train wandb-missing "$NGPU" 120 --set logging.wandb=offline
  echo "wandb-missing: the job ended after $((SECONDS - t0)) s; tagged lines: $(grep -c '^error: \[rank' "$OUT/wandb-missing.log")" \
    | tee -a "$S"; grep '^error: \[rank' "$OUT/wandb-missing.log" | tee -a "$S"
  train killed "$NGPU" 200 & job=$!
  until grep -qE '^step +3/' "$OUT/killed.log" 2>/dev/null || ! kill -0 $job 2>/dev/null; do sleep 0.5; done
  for p in $(pgrep -f "run_dir=$R/killed"); do
    tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx RANK=1 && kill -9 "$p" && log "SIGKILL rank 1 (pid $p)"
  done
  t0=$SECONDS; wait $job; echo "killed: the job ended $((SECONDS - t0)) s after the SIGKILL" | tee -a "$S"
  train "zero1-dp$NGPU" "$NGPU" 200 --set parallel.zero_stage=1 --set checkpoint.interval=12
  fork reshape-dp1 "zero1-dp$NGPU" 12
  train reshape-dp1 1 200 --set parallel.zero_stage=1
  grep -h '"event": "reshape"' "$R/reshape-dp1/metrics.jsonl" | tee -a "$S"
  python benchmarks/device/multi_summary.py $FLIP "$R/zero1-dp$NGPU" "$R/reshape-dp1:1" --resumed "$R/zero1-dp$NGPU:$R/reshape-dp1:12" \
    2>&1 | tee -a "$S"
  tar czf "$OUT/metrics-$MODE.tgz" -C "$R" zero1-dp$NGPU/metrics.jsonl reshape-dp1/metrics.jsonl
elif [ "$MODE" = slice ]; then
  COMMON=(--preset llmjp3-172b --set model.backend=te --set model.recompute=none --set parallel.tensor_parallel=1
          --set logging.wandb=disabled --set train.micro_batch_size=1 --set train.steps=8 --set optim.warmup_steps=2
          --set optim.decay_steps=8 --set train.eval_interval=0 --set checkpoint.interval=0
          --set checkpoint.save_at_end=false --set parallel.zero_stage=1
          --set "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 4, recipe: delayed, fp8_format: hybrid, amax_history_len: 1, amax_compute_algo: most_recent}]")
  train slice-2l-1gpu 1 240 --set "model.overrides={num_layers: 2}" --set train.global_batch_size=8 \
    --set parallel.pipeline_stages=1
  train "slice-4l-pp2-dp$((NGPU / 2))" "$NGPU" 300 --set "model.overrides={num_layers: 4}" \
    --set train.global_batch_size=$((8 * NGPU)) --set parallel.pipeline_stages=2
  python benchmarks/device/multi_summary.py 4 "$R/slice-2l-1gpu" "$R/slice-4l-pp2-dp$((NGPU / 2)):$NGPU" 2>&1 \
    | tee -a "$S"
  tar czf "$OUT/metrics-$MODE.tgz" -C "$R" $(cd "$R" && ls -d slice-*/metrics.jsonl)
fi
nvidia-smi --query-gpu=index,name,memory.used --format=csv >> "$S" 2>&1
