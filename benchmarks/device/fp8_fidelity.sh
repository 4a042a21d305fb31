#!/usr/bin/env bash
# On the H200s (device kind nvidia-h200-x2): FP8's loss penalty on real text, measured two ways: the gap between
# an FP8 run's loss trail and BF16 runs' (two seeds, for the noise), and the online fp8_penalty (each validation
# of an FP8 phase repeated with FP8 off); and what recipe: auto picks at the flip.
#   cp ../shared/data/llm-jp-tokenizer-v3/*.model .cache/tokenizer-v3.model      # here, once (carried)
#   source .whl/env.sh && bash benchmarks/device/fp8_fidelity.sh corpus+1 && bash benchmarks/device/fp8_fidelity.sh 2
# A 4-layer llmjp3-1.8b (seq 2048, global batch 8: 16k tokens per step), lr 3e-4 (100 warm-up steps, cosine to
# STEPS), BF16 then FP8 from step FLIP; validation every 100 steps on 4 global batches of the held-out 1 %.
# The corpus: benchmarks/real_text_corpus.py (the machine's Python sources, LLM-jp v3 tokenizer).
# Rounds run one queue per GPU: 1 = bf16 seed 42 | delayed, current | bf16 seed 43; 2 = block | auto.
# A dry run on the CPUs: NGPU=1 STEPS=6 FLIP=3 EVAL=2 EXTRA="--set model.backend=torch --set precision.emulate_fp8=true
#   --set model.overrides.num_layers=1 --set model.overrides.hidden_size=64 --set model.overrides.ffn_hidden_size=128 ..."
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LLMJP_DS_CACHE=$PWD/.cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TORCH_EXTENSIONS_DIR=/tmp/torch_ext
STEPS=${STEPS:-1100}; FLIP=${FLIP:-100}; EVAL=${EVAL:-100}; NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
CORPUS=${CORPUS:-/tmp/realtext}; R=${RUNS_DIR:-/tmp/fidelity}; mkdir -p "$R"
S="$OUT/summary-fidelity.txt"
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
COMMON=(--preset llmjp3-1.8b --set "model.overrides={num_layers: 4}" --set data.seq_len=2048
        --set "data.blend=[$CORPUS/python_text_document]" --set data.tokenizer=$PWD/.cache/tokenizer-v3.model
        --set logging.wandb=disabled --set train.global_batch_size=8 --set train.micro_batch_size=2
        --set train.steps=$STEPS --set optim.warmup_steps=$(( FLIP < 100 ? FLIP : 100 )) --set train.eval_interval=$EVAL
        --set train.eval_batches=4 --set checkpoint.interval=0 --set checkpoint.save_at_end=false)
fp8() { echo "precision.phases=[{precision: bf16}, {precision: fp8, start_step: $FLIP, recipe: $1, fp8_format: hybrid, amax_history_len: 1024, calibration_steps: 2}]"; }
run() {  # run NAME GPU --set ...
  local name=$1 gpu=$2; shift 2
  echo "=== $name on GPU $gpu ($(date +%T)): $*" | tee -a "$S"
  CUDA_VISIBLE_DEVICES=$gpu timeout 560 python -m llmjp_ds.train "${COMMON[@]}" --set run_dir="$R/$name" "$@" \
    "${EXTRA_ARGS[@]}" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? ($(date +%T))" | tee -a "$S"; grep -E "^step +[0-9]+/|^error|recipe auto" "$OUT/$name.log" | tail -2 | tee -a "$S"
}
queue() { local gpu=$1; shift; for spec in "$@"; do eval "run $spec $gpu \"\${ARGS_$spec[@]}\""; done; }
ARGS_bf16_s42=(--set train.seed=42); ARGS_bf16_s43=(--set train.seed=43)
ARGS_delayed=(--set "$(fp8 delayed)"); ARGS_current=(--set "$(fp8 current)"); ARGS_block=(--set "$(fp8 block)")
ARGS_auto=(--set "$(fp8 auto)" --set train.steps=$(( FLIP + 2 * EVAL )))
case "${1:?usage: fp8_fidelity.sh corpus+1|1|2|summary}" in
  corpus+1|corpus)
    [ -f "$CORPUS/python_text_document.idx" ] || python benchmarks/real_text_corpus.py --output-dir "$CORPUS" \
      --tokenizer .cache/tokenizer-v3.model --megabytes ${MEGABYTES:-250} 2>&1 | tee -a "$S" ;;&
  corpus+1|1)
    if [ "$NGPU" -ge 2 ]; then queue 0 bf16_s42 current & queue 1 delayed bf16_s43 & wait
    else queue 0 bf16_s42 delayed current bf16_s43; fi ;;
  2)
    if [ "$NGPU" -ge 2 ]; then queue 0 block & queue 1 auto & wait; else queue 0 block auto; fi ;;
esac
python benchmarks/device/fidelity_summary.py "$R" "$FLIP" 2>&1 | tee "$OUT/fidelity-table.md"
tar czf "$OUT/metrics-fidelity.tgz" -C "$R" $(cd "$R" && ls -d */metrics.jsonl 2>/dev/null)
