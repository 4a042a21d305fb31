# multi (2 GPUs of one host or more): the trainer's parallel layouts through the design card's launcher against
# one GPU, an 8-layer llmjp3-1.8b (micro-batch 2, global batch 8 per GPU of the largest data-parallel layout)
# through the BF16 -> FP8 delayed flip at step 8, 16 steps: ZeRO-1 and ZeRO-3 data parallel on every GPU, two
# pipeline stages and TP2 each times data parallel on the rest, and on 8 GPUs or more TP2 x PP2 x DP. The last
# layout checkpoints at step 12 (after the flip), which resumes on the same layout and on one GPU (a reshape)
# and exports (the shards merged, the export reloading it with transformers). multi_summary.py: each layout's
# loss against one GPU's, tokens/s and scaling.
LAUNCHER=deepspeed
EVEN=$(( NGPU / 2 * 2 ))
COMMON=(--preset llmjp3-1.8b --set "model.overrides={num_layers: 8}" --set model.backend=te
        --set logging.wandb=disabled --set train.global_batch_size=$(( 8 * NGPU )) --set train.micro_batch_size=2
        --set train.steps=16 --set optim.warmup_steps=4 --set train.eval_interval=0 --set checkpoint.interval=0
        --set checkpoint.keep_last=1 --set checkpoint.save_at_end=false
        --set "$(fp8_from 8)")
ZERO="--set parallel.zero_stage" PP="--set parallel.pipeline_stages=2" TP="--set parallel.tensor_parallel=2"
LAYOUTS=("zero1-dp$NGPU $NGPU $ZERO=1" "zero3-dp$NGPU $NGPU $ZERO=3" "pp2-dp$(( EVEN / 2 )) $EVEN $PP"
         "tp2-dp$(( EVEN / 2 )) $EVEN $TP")
(( NGPU >= 8 )) && LAYOUTS+=("tp2-pp2-dp$(( EVEN / 4 )) $EVEN $TP $PP")
train single 1
runs=()
for spec in "${LAYOUTS[@]}"; do
  read -r -a layout <<< "$spec"
  [ "$spec" = "${LAYOUTS[-1]}" ] && layout+=(--set checkpoint.interval=12)
  train "${layout[@]}"
  runs+=("$R/${layout[0]}:${layout[1]}")
done
if fork resumed "${layout[0]}" 12 && fork reshaped "${layout[0]}" 12; then
  train resumed "${layout[@]:1}"
  train reshaped 1
  for name in resumed reshaped; do trail "trail-$name" "${layout[0]}" "$name"; done
  export_run resumed
else
  verdict fork 1 "(${layout[0]} left no checkpoint of step 12)"
fi
logged layouts 60 python benchmarks/device/multi_summary.py 8 "$R/single" "${runs[@]}"
rc=$?
dry || grep -v '^+ ' "$LOGS/layouts.log" | note
verdict layouts "$rc" "(multi_summary.py)"
