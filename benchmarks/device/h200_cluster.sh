#!/usr/bin/env bash
# On the H200: the GPU side of a scheduler launch, and a checkpoint interval shorter than the write.
#   source .whl/env.sh && bash benchmarks/device/h200_cluster.sh
# 1. mpirun (Open MPI 4.1.6 is in the image; one GPU, so one rank): the 4-layer llmjp3-1.8b, BF16 then FP8
#    delayed from step 4. The rank takes its place from OMPI_COMM_WORLD_* (`launch: openmpi`) and its GPU from
#    the local rank; SIGUSR1 (a Slurm `--signal=USR1@...`) after step 7 saves and exits 0, the relaunch under
#    mpirun resumes from that checkpoint, and its trail must equal an uninterrupted mpirun run of 12 steps.
# 2. the whole llmjp3-1.8b with a background save every 6 steps (25 GB each, ~1 GB/s here): the save at step 12
#    waits for step 6's write and says so once, with the smallest interval that would not wait.
set -uo pipefail
MODE=cluster
source benchmarks/device/lib.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
SMALL=(--preset llmjp3-1.8b --set "model.overrides={num_layers: 4}" --set logging.wandb=disabled
       --set train.global_batch_size=16 --set train.micro_batch_size=2 --set train.steps=12 --set optim.decay_steps=12
       --set train.eval_interval=0 --set checkpoint.interval=0 --set model.backend=te
       --set "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 4, recipe: delayed}]"
       --set "checkpoint.stop_signals=[SIGTERM, SIGINT, SIGUSR1]" "${EXTRA_ARGS[@]}")
rm -rf "$R"/mpi-full "$R"/mpi-stopped "$R"/interval
mpi() {  # mpi NAME [--set ...]: one rank under mpirun, appending to $OUT/NAME.log, in the background
  local name=$1; shift
  mpirun -np 1 --bind-to none -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="${PORT:-29561}" -x PATH -x PYTHONPATH \
    -x LD_LIBRARY_PATH -x LLMJP_DS_CACHE -x TORCH_EXTENSIONS_DIR -x TORCH_CUDA_ARCH_LIST \
    python -m llmjp_ds.train "${SMALL[@]}" --set run_dir="$R/$name" "$@" >> "$OUT/$name.log" 2>&1 &
}
log "mpirun: where the rank finds its place"
mpirun -np 1 --bind-to none -x PATH -x PYTHONPATH -x LD_LIBRARY_PATH python -m llmjp_ds.cli preflight \
  --hostfile hostfiles/localhost 2>&1 | grep -E "^launch|^error" | tee -a "$S"
log "mpirun: 12 steps uninterrupted"
mpi mpi-full; wait $!; echo "mpi-full rc=$?" | tee -a "$S"
grep -E "launch:|^step +(3|4|12)/|^error" "$OUT/mpi-full.log" | tee -a "$S"
log "mpirun: SIGUSR1 to the rank after step 7, then the same command again"
mpi mpi-stopped; runner=$!
for _ in $(seq 1500); do grep -qE "^step +7/" "$OUT/mpi-stopped.log" && break; sleep 0.2; done
rank=$(pgrep -f "run_dir=$R/mpi-stopped" | grep -v "^$runner\$" | while read -r p; do
  [ "$(ps -o comm= -p "$p")" != mpirun ] && echo "$p"; done | head -1)
echo "SIGUSR1 to rank pid $rank" | tee -a "$S"; kill -USR1 "$rank"
wait "$runner"; echo "stopped rc=$? latest $(cat "$R/mpi-stopped/checkpoints/latest")" | tee -a "$S"
grep '"event": "preempted"' "$R/mpi-stopped/metrics.jsonl" | tee -a "$S"
mpi mpi-stopped; wait $!; echo "resumed rc=$?" | tee -a "$S"
grep '"event": "resume"' "$R/mpi-stopped/metrics.jsonl" | tee -a "$S"
python - "$R/mpi-full" "$R/mpi-stopped" <<'PY' | tee -a "$S"
import json, sys
def trail(d):
    out = {}
    for line in open(f"{d}/metrics.jsonl"):
        r = json.loads(line)
        if "loss" in r and "event" not in r:
            out[r["step"]] = (r["loss"], r["grad_norm"], r["precision"])
    return out
full, stopped = (trail(d) for d in sys.argv[1:])
print("precision by step:", [full[s][2] for s in sorted(full)])
same = [s for s in sorted(full) if full[s] == stopped.get(s)]
print(f"stopped + resumed against uninterrupted: {len(same)} of {len(full)} steps equal (loss, grad norm, precision)")
for s in sorted(full):
    if full[s] != stopped.get(s):
        print(f"  step {s}: {full[s]} vs {stopped.get(s)}")
PY
log "the whole llmjp3-1.8b, a background save every 6 steps"
CUDA_VISIBLE_DEVICES=0 timeout 400 python -m llmjp_ds.train --preset llmjp3-1.8b --set logging.wandb=disabled \
  --set train.global_batch_size=16 --set train.micro_batch_size=2 --set train.steps=13 --set checkpoint.interval=6 \
  --set checkpoint.keep_last=1 --set checkpoint.save_at_end=false --set train.eval_interval=0 \
  --set model.backend=te --set run_dir="$R/interval" > "$OUT/interval.log" 2>&1
echo "interval rc=$?" | tee -a "$S"
grep -E "^warning|^error" "$OUT/interval.log" | tee -a "$S"
grep -E '"event": "checkpoint_(waited|committed)"' "$R/interval/metrics.jsonl" | tee -a "$S"
rm -rf "$R/interval/checkpoints"
cat "$S"
