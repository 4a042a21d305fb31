# Shared by the device scripts (source it): the environment, a log, and launching the trainer.
# Expects MODE set; sets OUT, R (run directories), S (the summary file), EXTRA_ARGS (from $EXTRA).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LLMJP_DS_CACHE=$PWD/.cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TORCH_EXTENSIONS_DIR=/tmp/torch_ext
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
R=${RUNS_DIR:-/tmp/runs}; mkdir -p "$R"
S="$OUT/summary-${SUMMARY:-$MODE}.txt"
log() { echo "=== $* ($(date +%T), disk free $(df -h --output=avail /tmp | tail -1))" | tee -a "$S"; }
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
# train NAME GPUS TIMEOUT --set ...: one process per GPU (torchrun), appending to $OUT/NAME.log
train() {
  local name=$1 gpus=$2 limit=$3; shift 3
  local launcher=(python -m torch.distributed.run --standalone --nproc_per_node="$gpus")
  [ "$gpus" = 1 ] && launcher=(env CUDA_VISIBLE_DEVICES=0 python)
  log "$name on $gpus GPU(s): $*"
  timeout "$limit" "${launcher[@]}" -m llmjp_ds.train "${COMMON[@]}" --set run_dir="$R/$name" "$@" \
    "${EXTRA_ARGS[@]}" >> "$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$S"; grep -E "^step +[0-9]+/|^error" "$OUT/$name.log" | tail -2 | tee -a "$S"
}
# fork NAME FROM STEP: a new run dir holding FROM's checkpoint at STEP (hard links) as its latest (the resume
# drops the metrics after STEP)
fork() {
  local step; step=$(printf "step%08d" "$3")
  mkdir -p "$R/$1/checkpoints" && cp -al "$R/$2/checkpoints/$step" "$R/$1/checkpoints/" \
    && echo "$step" > "$R/$1/checkpoints/latest" && cp -r "$R/$2/tokenizer" "$R/$2/metrics.jsonl" "$R/$1/"
}
export_run() {  # export NAME's latest checkpoint on the CPUs, in the background
  (CUDA_VISIBLE_DEVICES= timeout 400 python -m llmjp_ds.cli export --run "$R/$1" --output "/tmp/hf_$1" \
     --dtype bf16 --force > "$OUT/export_$1.log" 2>&1; echo "export $1 rc=$?: $(tail -1 "$OUT/export_$1.log")" >> "$S") &
}
