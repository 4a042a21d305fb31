#!/usr/bin/env bash
# Tensor parallelism on two H200s (device kind nvidia-h200-x2; TP=4 for bench and memory on nvidia-h200-x4):
#   source .whl/env.sh && [TP=4] bash benchmarks/device/h200_tp.sh bench|train|memory|profile
# bench: `llmjp-ds bench` at the 172B layer shape (seq 4096, micro-batch 1, GAS 8, the full DeepSpeed step),
#   BF16 and FP8 delayed: 2 layers on one GPU (TP1), then 2 x TP layers as one TP group on TP GPUs (per GPU:
#   the same two layers' work, 1/TP of the vocabulary-parallel embedding and head). TFLOP/s per GPU, TP over
#   TP1, is the per-GPU efficiency of tensor parallelism.
# train: an 8-layer llmjp3-1.8b (seq 4096, global batch 16, micro-batch 2), 16 steps, FP8 delayed from step 9
#   (calibrated on steps 7-8): one GPU, then TP2 (sequence parallel) with a checkpoint at step 12, a resume of
#   that checkpoint (12 -> 16) against the uninterrupted TP2 run, and the export of the TP2 checkpoint (the
#   shards merged into one HF checkpoint, on the CPUs, with the export's reload parity check).
# memory: per GPU what the llmjp3-172b preset's busiest stage holds (TP4 x PP16 stage 0: 6 layers / 4 and the
#   embedding / 4) as a TP run of 6 x TP / 4 layers with a 99,840 x TP / 4-row vocabulary (TP2: 3 layers and
#   49,920 rows; TP4: the preset's own 6 layers and vocabulary), selective recompute, micro-batch 1, seq 4096,
#   3 BF16 steps: peak memory against
#   `llmjp-ds preflight`'s estimate of the same run (this run has a head as well, and one micro-batch in flight
#   rather than 1F1B's 16: the estimate's per-micro-batch activation term is what 1F1B multiplies). It runs
#   the pipeline's DeepSpeed JSON (BF16_Optimizer: fp32 gradient accumulation), which the estimate models.
# reshape: the train mode's TP2 run to step 16 with a checkpoint at step 12 (after the flip), and that checkpoint
#   resumed on one GPU (TP2 -> TP1: the shards merged by the conversion) against the uninterrupted TP2 run.
# profile: `llmjp-ds bench --profile` of the whole llmjp3-1.8b at TP2 (BF16): where a small model's step goes
#   under tensor parallelism.
set -uo pipefail
MODE=${1:?usage: h200_tp.sh bench|train|reshape|memory|profile}
TP=${TP:-2}
SUMMARY=tp$TP-$MODE source benchmarks/device/lib.sh

if [ "$MODE" = bench ]; then
  B=(python -m llmjp_ds.cli bench --shapes 172b-slice --variants ours-bf16,ours-fp8-delayed --steps 4 --warmup 2)
  log "bench TP1, 2 layers, one GPU"
  CUDA_VISIBLE_DEVICES=0 timeout 280 "${B[@]}" --json "$OUT/bench-tp1.json" 2>&1 | tee "$OUT/bench-tp1.log" \
    | grep "^|" | tee -a "$S"
  log "bench TP$TP, $((2 * TP)) layers, $TP GPUs"
  timeout 280 "${B[@]}" --set parallel.tensor_parallel=$TP --set "model.overrides={num_layers: $((2 * TP))}" \
    --json "$OUT/bench-tp$TP.json" 2>&1 | tee "$OUT/bench-tp$TP.log" | grep "^|" | tee -a "$S"
  python - "$OUT/bench-tp1.json" "$OUT/bench-tp$TP.json" $TP <<'EOF' 2>&1 | tee -a "$S"
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:3])
tp = sys.argv[3]
print(f"| variant | TP1 2 layers, TFLOP/s per GPU | TP{tp} {2 * int(tp)} layers, TFLOP/s per GPU | per-GPU efficiency | "
      f"peak GiB TP1 / TP{tp} |")
print("|---|---|---|---|---|")
for a in one:
    b = next((x for x in two if x["variant"] == a["variant"]), None)
    if b is None or "error" in a or "error" in b:
        print(f"| {a['variant']} | {a.get('error', '')} | {b and b.get('error', '')} | | |")
        continue
    print(f"| {a['variant']} | {a['tflops_per_gpu']:.0f} | {b['tflops_per_gpu']:.0f} | "
          f"{100 * b['tflops_per_gpu'] / a['tflops_per_gpu']:.1f}% | {a['peak_mem_gib']:.1f} / {b['peak_mem_gib']:.1f} |")
EOF
elif [ "$MODE" = train ] || [ "$MODE" = reshape ]; then
  FLIP=8
  COMMON=(--preset llmjp3-1.8b --set "model.overrides={num_layers: 8}" --set model.backend=te
          --set logging.wandb=disabled --set train.global_batch_size=16 --set train.micro_batch_size=2
          --set train.steps=16 --set optim.warmup_steps=4 --set optim.decay_steps=16 --set train.eval_interval=0
          --set checkpoint.interval=0 --set checkpoint.keep_last=1 --set checkpoint.save_at_end=false
          --set precision.log_amax=true
          --set "precision.phases=[{precision: bf16}, {precision: fp8, start_step: $FLIP, recipe: delayed, fp8_format: hybrid, amax_history_len: 16, calibration_steps: 2}]")
  if [ "$MODE" = reshape ]; then
    train tp2 2 200 --set parallel.tensor_parallel=2 --set checkpoint.interval=12
    fork tp1-reshaped tp2 12 && train tp1-reshaped 1 200
    grep -h '"event": "reshape"' "$R/tp1-reshaped/metrics.jsonl" | tee -a "$S"
    python benchmarks/device/multi_summary.py $FLIP "$R/tp2" "$R/tp1-reshaped:1" --resumed "$R/tp2:$R/tp1-reshaped:12" \
      2>&1 | tee -a "$S"
    exit 0
  fi
  train single 1 200
  train tp2 2 200 --set parallel.tensor_parallel=2 --set checkpoint.interval=12
  fork tp2-resumed tp2 12 && export_run tp2-resumed
  train tp2-resumed 2 200 --set parallel.tensor_parallel=2
  log "waiting for the export"; wait
  python benchmarks/device/multi_summary.py $FLIP "$R/single" "$R/tp2:2" --resumed "$R/tp2:$R/tp2-resumed:12" \
    2>&1 | tee -a "$S"
  tar czf "$OUT/metrics-tp-$MODE.tgz" -C "$R" single/metrics.jsonl tp2/metrics.jsonl tp2-resumed/metrics.jsonl
elif [ "$MODE" = memory ]; then
  SLICE=(--preset llmjp3-172b --set "model.overrides={num_layers: $((6 * TP / 4)), vocab_size: $((99840 * TP / 4))}"
         --set parallel.tensor_parallel=$TP
         --set parallel.pipeline_stages=1 --set model.recompute=selective --set train.micro_batch_size=1
         --set train.global_batch_size=2 --set parallel.ds_config=ds_configs/pipeline.json)
  echo "localhost slots=$TP" > "$OUT/hosts-$TP"
  log "preflight's estimate"
  python -m llmjp_ds.cli preflight --hostfile "$OUT/hosts-$TP" --gpu-gib 139.8 "${SLICE[@]}" 2>&1 | grep -v WARN | tee -a "$S"
  COMMON=("${SLICE[@]}" --set model.backend=te --set logging.wandb=disabled --set train.steps=3
          --set train.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.save_at_end=false
          --set optim.warmup_steps=1 --set "precision.phases=[{precision: bf16}]")
  train slice-tp$TP-memory $TP 300
  grep -o '"peak_memory_gib": [0-9.]*' "$R/slice-tp$TP-memory/metrics.jsonl" | tee -a "$S"
elif [ "$MODE" = profile ]; then
  timeout 400 python -m llmjp_ds.cli bench --shapes llmjp3-1.8b --variants ours-bf16 --steps 3 --warmup 2 --profile \
    --set parallel.tensor_parallel=2 --json "$OUT/bench-1.8b-tp2-profile.json" 2>&1 | tee "$OUT/bench-1.8b-tp2-profile.log" \
    | grep -E "^\||^profile|^host" | head -60 | tee -a "$S"
fi
nvidia-smi --query-gpu=index,name,memory.used --format=csv >> "$S" 2>&1
