#!/usr/bin/env bash
# On the H200: background checkpoints on the whole llmjp3-1.8b preset (bundled corpus, BF16, global batch 16,
# micro-batch 2, a save every 6 steps, ~25 GB each), against one synchronous save, and a kill -9 in the middle
# of a background write.
#   source .whl/env.sh && bash benchmarks/device/h200_async.sh
# 1. async: 20 steps, saves at 6, 12, 18; the stall of each save, the steps during the writes (INTERVAL=N:
#    this run alone, saving every N steps);
# 2. with SYNC=1, sync: one save at step 6 (the stall the loop used to see);
# 3. kill -9 at step 14 of the same async run (step 12's write in flight); the relaunch resumes from step 6 and
#    must log run 1's losses for steps 7-20.
set -uo pipefail
MODE=async
source benchmarks/device/lib.sh
COMMON=(--preset llmjp3-1.8b --set logging.wandb=disabled --set train.global_batch_size=16
        --set train.micro_batch_size=2 --set train.steps=20 --set checkpoint.interval=6 --set checkpoint.keep_last=1
        --set checkpoint.save_at_end=false --set train.eval_interval=0 --set model.backend=te "${EXTRA_ARGS[@]}")
summary() { python benchmarks/device/async_summary.py "$@" | tee -a "$S"; }
rm -rf "$R"/async "$R"/sync "$R"/killed  # a warm machine keeps /tmp: earlier runs' 25 GB checkpoints
log "the disk: 8 GiB written with fdatasync"
dd if=/dev/zero of=/tmp/ddtest bs=1M count=8192 conv=fdatasync 2>&1 | tail -1 | tee -a "$S"; rm -f /tmp/ddtest
free_ckpts() { rm -rf "$1/checkpoints"; }

if [ -n "${INTERVAL:-}" ]; then  # only the async run, saving every INTERVAL steps (a write that fits between)
  train "async-$INTERVAL" 1 400 --set checkpoint.async_save=true --set checkpoint.interval="$INTERVAL" \
    --set train.steps=$((2 * INTERVAL + 5))
  summary "$R/async-$INTERVAL"; free_ckpts "$R/async-$INTERVAL"; cat "$S"; exit 0
fi
train async 1 240 --set checkpoint.async_save=true
summary "$R/async"; free_ckpts "$R/async"
[ "${SYNC:-0}" = 1 ] && { train sync 1 170 --set checkpoint.async_save=false --set train.steps=7
  summary "$R/sync"; free_ckpts "$R/sync"; }

log "kill -9 at step 14 (the write of step 12 in flight)"
CUDA_VISIBLE_DEVICES=0 python -m llmjp_ds.train "${COMMON[@]}" --set run_dir="$R/killed" > "$OUT/killed.log" 2>&1 &
pid=$!
for _ in $(seq 900); do grep -qE "^step +14/" "$OUT/killed.log" && break; sleep 0.2; done
kill -9 "$pid"; wait "$pid" 2>/dev/null
echo "killed at: $(grep -E '^step +[0-9]+/' "$OUT/killed.log" | tail -1 | cut -c1-12); latest $(cat "$R/killed/checkpoints/latest"); tags: $(ls "$R/killed/checkpoints" | grep ^step | tr '\n' ' ')" | tee -a "$S"
ls "$R/killed/checkpoints/step00000012" 2>/dev/null | tr '\n' ' ' | sed 's/^/step 12 files: /' | tee -a "$S"; echo | tee -a "$S"
train killed 1 200
grep '"event": "resume"' "$R/killed/metrics.jsonl" | tail -1 | tee -a "$S"
python - "$R/async" "$R/killed" <<'PY' | tee -a "$S"
import json, sys
def trail(d):
    out = {}
    for line in open(f"{d}/metrics.jsonl"):
        r = json.loads(line)
        if "loss" in r and "event" not in r:
            out[r["step"]] = r["loss"]
    return out
a, k = (trail(d) for d in sys.argv[1:])
diff = max(abs(a[s] - k[s]) / abs(a[s]) for s in range(7, 21))
print(f"steps 7-20 after the kill -9 against the uninterrupted async run: max relative loss difference {diff:.2e}")
PY
cat "$S"
