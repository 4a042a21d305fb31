#!/usr/bin/env bash
# On the H200: a run's files survive the launcher's death and planted content, with TE and FP8 state present.
#   source .whl/env.sh && bash benchmarks/device/h200_trust.sh
# 1. `deepspeed --hostfile H --no_ssh_check --master_addr 127.0.0.1 llmjp_ds/train.py ...` (TE backend, BF16 then
#    FP8 delayed from step 4), SIGTERM to the launcher's pid alone at step 12: the trainer must save one
#    checkpoint and exit 0, with no process of the job left; the same command again resumes from it.
# 2. Copies of that post-flip checkpoint (TE's pickled DelayedScaling extra state inside): untouched, it resumes;
#    with os.system planted in a TE `_extra_state` or in the model states (manifest rewritten to match) the
#    resume is refused in one line and the payload never runs; planted without the manifest, the resume falls
#    back to the tag before it.
set -uo pipefail
MODE=trust
source benchmarks/device/lib.sh
export PATH=/tmp/site/bin:$PATH  # the deepspeed launcher, from the carried wheel
H="$OUT/hostfile"; echo "localhost slots=1" > "$H"
COMMON=(--preset demo --set model.backend=te --set precision.dtype=bf16 --set logging.wandb=disabled
        --set "model.overrides={hidden_size: 1024, num_layers: 2, num_attention_heads: 8, num_key_value_heads: 8, ffn_hidden_size: 4096}"
        --set data.seq_len=256 --set train.global_batch_size=8 --set train.micro_batch_size=2
        --set train.eval_interval=0 --set optim.warmup_steps=2 --set checkpoint.keep_last=3
        --set "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 4, recipe: delayed, amax_history_len: 16}]"
        "${EXTRA_ARGS[@]}")  # a dry run on a CPU: EXTRA="--set model.backend=torch --set precision.emulate_fp8=true"
launch() {  # launch LOG STEPS INTERVAL: the design card's command, in the background; its runner's pid in $!
  deepspeed --hostfile "$H" --no_ssh_check --master_addr 127.0.0.1 --master_port "$((29600 + RANDOM % 300))" \
    llmjp_ds/train.py "${COMMON[@]}" --set run_dir="$R/main" --set train.steps="$2" --set checkpoint.interval="$3" \
    >> "$OUT/$1.log" 2>&1 &
}
trainers() {  # pids of the job's processes still alive (the runner, DeepSpeed's launch, the rank)
  for p in /proc/[0-9]*; do
    tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -q "train.py.*run_dir=$R/main " && echo "${p#/proc/}"
  done; true; }

log "1. launcher SIGTERM at step 12 (400 steps, a checkpoint every 5)"
launch launcher-sigterm 400 5; runner=$!
for _ in $(seq 600); do grep -qE "^step +12/" "$OUT/launcher-sigterm.log" && break; sleep 0.5; done
echo "trainer pids before: $(trainers | tr '\n' ' ')" | tee -a "$S"
kill -TERM "$runner"; wait "$runner"; echo "launcher exited rc=$?" | tee -a "$S"
for _ in $(seq 120); do [ -z "$(trainers)" ] && break; sleep 1; done
echo "trainer pids 120 s later: '$(trainers | tr '\n' ' ')'" | tee -a "$S"
grep -E "^step +[0-9]+/" "$OUT/launcher-sigterm.log" | tail -1 | tee -a "$S"
grep -E "^error|^warning|preempt|Traceback" "$OUT/launcher-sigterm.log" | head -5 | tee -a "$S"
echo "latest: $(cat "$R/main/checkpoints/latest" 2>/dev/null); tags: $(ls "$R/main/checkpoints" | grep ^step | tr '\n' ' ')" | tee -a "$S"
echo "preempted events: $(grep -c '"event": "preempted"' "$R/main/metrics.jsonl")" | tee -a "$S"
tag=$(cat "$R/main/checkpoints/latest"); step=$((10#${tag:4:8}))
cp -r "$R/main" "$R/pristine"  # before the relaunch moves on: the post-flip checkpoint, for part 2

log "1b. the same command again: resumes from $tag"
launch relaunch $((step + 4)) 0; wait $!; echo "relaunch rc=$?" | tee -a "$S"
grep -E '"event": "resume"' "$R/main/metrics.jsonl" | tail -1 | tee -a "$S"
grep -E "^step +[0-9]+/|^error|Traceback" "$OUT/relaunch.log" | head -2 | tee -a "$S"
grep -E "^step +[0-9]+/" "$OUT/relaunch.log" | tail -1 | tee -a "$S"

resume() {  # resume NAME: train 2 more steps from a copy of the post-flip checkpoint, on one GPU
  timeout 300 python -m llmjp_ds.train "${COMMON[@]}" --set run_dir="$R/$1" --set train.steps=$((step + 2)) \
    --set checkpoint.interval=0 > "$OUT/$1.log" 2>&1
  echo "$1 rc=$?" | tee -a "$S"
  grep -E "^error|^warning" "$OUT/$1.log" | head -3 | tee -a "$S"
  grep -E "^step +[0-9]+/" "$OUT/$1.log" | head -1 | tee -a "$S"
}
for name in untouched extra model fallback; do rm -rf "$R/$name"; cp -r "$R/pristine" "$R/$name"; done
d() { echo "$R/$1/checkpoints/$tag"; }
log "2. planted pickles in the post-flip checkpoint $tag"
python benchmarks/device/plant.py "$(d extra)" mp_rank_00_model_states.pt extra "$OUT/ran-extra" | tee -a "$S"
python benchmarks/device/plant.py "$(d model)" mp_rank_00_model_states.pt train_state "$OUT/ran-model"
python benchmarks/device/plant.py "$(d fallback)" mp_rank_00_model_states.pt extra "$OUT/ran-fallback" \
  --keep-manifest > /dev/null
for name in untouched extra model fallback; do log "resume $name"; resume "$name"; done
echo "payload ran: $(ls "$OUT"/ran-* 2>/dev/null | wc -l) of 3" | tee -a "$S"
grep -h '"event": "checkpoint_fallback"' "$R/fallback/metrics.jsonl" | tee -a "$S"
log "the relaunch's first step after $tag against the untouched copy's"
grep -E "^step +$((step + 1))/" "$OUT/relaunch.log" "$OUT/untouched.log" | tee -a "$S"
ls /dev/shm | grep -c deepspeed | sed 's/^/deepspeed shm buffers left: /' | tee -a "$S"
cat "$S"
