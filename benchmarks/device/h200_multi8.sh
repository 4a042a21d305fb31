#!/usr/bin/env bash
# Runs on 4-8 H200s of one host (device kinds nvidia-h200-x4 / -x8; NGPU = the GPUs it has):
#   source .whl/env.sh && bash benchmarks/device/h200_multi8.sh 3d|scale|13b|launcher
# TP4 at the 172B stage shape is h200_tp.sh's: TP=4 bash benchmarks/device/h200_tp.sh bench|memory (x4).
# 3d (x8): an 8-layer llmjp3-1.8b (seq 4096, global batch 16, micro-batch 2), 16 steps, FP8 delayed from step 9:
#   one GPU, then TP2 x PP2 x DP2 with a checkpoint at step 12; that checkpoint resumed on the same layout (12 ->
#   16, against the uninterrupted run), resumed on TP2 x PP2 x DP1 (4 GPUs: a reshape), and exported (the
#   shards merged, with the export's reload parity check).
# scale: the whole llmjp3-1.8b and llmjp3-3.7b (micro-batch 2 / 1, 8 micro-batches per GPU a step, FP8 delayed
#   from step 9) on 1, 2, 4 and NGPU GPUs as ZeRO-1 data parallel, and 3.7B as TP2 x DP(NGPU/2): tokens/s per
#   GPU against one GPU's, BF16 and FP8 (multi_summary.py).
# 13b (x8): llmjp3-13b as TP2 x DP4 (ZeRO-1, seq 4096, micro-batch 1, global batch 32), 50 steps with the flip to
#   FP8 delayed at step 25, a checkpoint at the end, its export loaded by AutoModelForCausalLM (the export's own
#   check), per-GPU TFLOP/s from the log.
# launcher: the design card's command on every GPU of the host, through the DeepSpeed launcher and a hostfile
#   (`deepspeed --hostfile hostfiles/localhost --no_ssh_check --master_addr 127.0.0.1 llmjp_ds/train.py ...`),
#   an 8-layer llmjp3-1.8b as TP2 x DP(NGPU/2), 8 steps.
set -uo pipefail
MODE=${1:?usage: h200_multi8.sh 3d|scale|13b|launcher}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
SUMMARY=multi8-$MODE source benchmarks/device/lib.sh
FLIP=8
phases() {  # BF16, then FP8 delayed (hybrid) from step $1, calibrated on the 2 steps before
  echo "precision.phases=[{precision: bf16}, {precision: fp8, start_step: $1, recipe: delayed, fp8_format: hybrid, amax_history_len: 16, calibration_steps: 2}]"
}
base() {  # COMMON for preset $1, micro-batch $2, global batch $3, $4 steps
  COMMON=(--preset "$1" --set model.backend=te --set logging.wandb=disabled --set train.micro_batch_size="$2"
          --set train.global_batch_size="$3" --set train.steps="$4" --set optim.warmup_steps=4
          --set optim.decay_steps="$4" --set train.eval_interval=0 --set checkpoint.interval=0
          --set checkpoint.keep_last=2 --set checkpoint.save_at_end=false --set parallel.pipeline_stages=1
          --set parallel.tensor_parallel=1 --set "$(phases $FLIP)")
}

if [ "$MODE" = 3d ]; then
  base llmjp3-1.8b 2 16 16; COMMON+=(--set "model.overrides={num_layers: 8}")
  D3=(--set parallel.tensor_parallel=2 --set parallel.pipeline_stages=2)
  train single 1 200
  train tp2-pp2-dp2 8 300 "${D3[@]}" --set checkpoint.interval=12
  fork tp2-pp2-dp2-resumed tp2-pp2-dp2 12 && fork tp2-pp2-dp1-reshaped tp2-pp2-dp2 12 && export_run tp2-pp2-dp2-resumed
  train tp2-pp2-dp2-resumed 8 200 "${D3[@]}"
  CUDA_VISIBLE_DEVICES=0,1,2,3 train tp2-pp2-dp1-reshaped 4 200 "${D3[@]}"
  grep -h '"event": "reshape"' "$R/tp2-pp2-dp1-reshaped/metrics.jsonl" | tee -a "$S"
  log "waiting for the export"; wait
  python benchmarks/device/multi_summary.py $FLIP "$R/single" "$R/tp2-pp2-dp2:8" "$R/tp2-pp2-dp1-reshaped:4" \
    --resumed "$R/tp2-pp2-dp2:$R/tp2-pp2-dp2-resumed:12" "$R/tp2-pp2-dp2:$R/tp2-pp2-dp1-reshaped:12" 2>&1 | tee -a "$S"
elif [ "$MODE" = scale ]; then
  for spec in "llmjp3-1.8b 2" "llmjp3-3.7b 1"; do
    read -r preset micro <<< "$spec"
    runs=()
    for gpus in 1 2 4 "$NGPU"; do
      [ "$gpus" -gt "$NGPU" ] && continue
      base "$preset" "$micro" $((8 * micro * gpus)) 16
      name="$preset-dp$gpus"
      [ -d "$R/$name" ] || CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1))) train "$name" "$gpus" 400
      runs+=("$R/$name:$gpus")
    done
    if [ "$preset" = llmjp3-3.7b ]; then  # the best TP x DP mix on all GPUs: TP2 (TP4 splits 3.7B's GEMMs too thin)
      base "$preset" "$micro" $((8 * micro * NGPU / 2)) 16
      train "$preset-tp2-dp$((NGPU / 2))" "$NGPU" 400 --set parallel.tensor_parallel=2
      runs+=("$R/$preset-tp2-dp$((NGPU / 2)):$NGPU")
    fi
    python benchmarks/device/multi_summary.py $FLIP "${runs[0]%%:*}" "${runs[@]:1}" 2>&1 | sed '/^loss per step/,$d' \
      | tee -a "$S"
  done
elif [ "$MODE" = 13b ]; then
  base llmjp3-13b 1 32 50; COMMON+=(--set "$(phases 25)")
  train 13b-tp2-dp4 8 560 --set parallel.tensor_parallel=2 --set checkpoint.save_at_end=true
  export_run 13b-tp2-dp4; log "waiting for the export"; wait
  grep -E "^step +(10|20|24|30|40|50)/" "$OUT/13b-tp2-dp4.log" | tee -a "$S"
elif [ "$MODE" = launcher ]; then
  base llmjp3-1.8b 2 $((16 * NGPU / 2)) 8; COMMON+=(--set "model.overrides={num_layers: 8}")
  printf "localhost slots=%s\n" "$NGPU" > "$OUT/hostfile"
  log "deepspeed --hostfile $OUT/hostfile llmjp_ds/train.py (TP2 x DP$((NGPU / 2)))"
  timeout 400 deepspeed --hostfile "$OUT/hostfile" --no_ssh_check --master_addr 127.0.0.1 llmjp_ds/train.py \
    "${COMMON[@]}" --set run_dir="$R/launcher" --set parallel.tensor_parallel=2 >> "$OUT/launcher.log" 2>&1
  echo "launcher rc=$?" | tee -a "$S"; grep -E "^step +[0-9]+/|^error" "$OUT/launcher.log" | tail -3 | tee -a "$S"
fi
tar czf "$OUT/metrics-$MODE.tgz" -C "$R" $(cd "$R" && ls -d */metrics.jsonl 2>/dev/null)
nvidia-smi --query-gpu=index,name,memory.used --format=csv >> "$S" 2>&1
