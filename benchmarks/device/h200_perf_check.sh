#!/usr/bin/env bash
# On the H200: the trainer with this release's fast paths (fused fp32 gradient accumulation, FP8 weight cache,
# compiled loss) through a BF16 -> FP8 delayed flip, evaluation and a checkpoint resume, against the same run
# with all three switched off (MODEL_TESTS=1: then the model's GPU tests).
#   source .whl/env.sh && bash benchmarks/device/h200_perf_check.sh
# A 4-layer llmjp3-1.8b (checkpoints of a few GB), the bundled corpus, 12 steps, FP8 from step 6 (calibrated on
# steps 4-5); EVAL_INTERVAL=N validates every N steps (needs a corpus with a valid split of 4097+ tokens). Runs: `full` (0-12), `resumed` (0-8, checkpoint, then 8-12: the loss
# trail must repeat `full`'s), `plain` (0-12, the three switches off: the same trail within bf16/FP8 noise).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LLMJP_DS_CACHE=$PWD/.cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
R=/tmp/runs; rm -rf $R; mkdir -p $R
S="$OUT/summary.txt"
COMMON=(--preset llmjp3-1.8b --set "model.overrides={num_layers: 4}" --set model.backend=te
        --set logging.wandb=disabled --set train.global_batch_size=8 --set train.micro_batch_size=2
        --set optim.warmup_steps=4 --set optim.decay_steps=12 --set train.eval_interval=${EVAL_INTERVAL:-0}
        --set checkpoint.keep_last=1 --set checkpoint.save_at_end=false --set precision.log_amax=true
        --set "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 6, recipe: delayed, fp8_format: hybrid, amax_history_len: 16, calibration_steps: 2}]")
# a dry run on a CPU: EXTRA="--set model.backend=torch --set precision.emulate_fp8=true --set model.shape=tiny ..."
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"; COMMON+=("${EXTRA_ARGS[@]}")
train() { local name=$1; shift; echo "=== $name $* ($(date +%T))" | tee -a "$S"
  timeout 100 python -m llmjp_ds.train "${COMMON[@]}" --set run_dir=$R/$name "$@" >> "$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$S"; grep -E "^step [0-9]+/|^error" "$OUT/$name.log" | tail -2 | tee -a "$S"; }
RUNS=${RUNS:-full resumed plain}
[[ $RUNS == *full* ]] && train full --set train.steps=12 --set checkpoint.interval=0
if [[ $RUNS == *resumed* ]]; then
  train resumed --set train.steps=8 --set checkpoint.interval=8
  train resumed --set train.steps=12 --set checkpoint.interval=0
fi
[[ $RUNS == *plain* ]] && train plain --set train.steps=12 --set checkpoint.interval=0 \
  --set parallel.fused_grad_accumulation=false --set precision.fp8_weight_cache=false --set model.fused_loss=false
python - "$R" <<'PY' 2>&1 | tee -a "$S"
import json, sys
from pathlib import Path
def trail(name):
    out = {}
    if not (Path(sys.argv[1]) / name / "metrics.jsonl").is_file():
        return out
    for line in (Path(sys.argv[1]) / name / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "event" not in r:
            out[r["step"]] = (r["loss"], r.get("valid_loss"), r.get("precision"), r.get("tflops_per_gpu"))
    return out
full, resumed, plain = trail("full"), trail("resumed"), trail("plain")
print("| step | precision | full loss | resumed loss | plain loss | full valid | resumed valid | plain valid | full TFLOP/s |")
print("|---|---|---|---|---|---|---|---|---|")
for s in sorted(full):
    f, r, p = full[s], resumed.get(s, (None,) * 4), plain.get(s, (None,) * 4)
    print(f"| {s} | {f[2]} | {f[0]:.5f} | {r[0]} | {p[0]} | {f[1]} | {r[1]} | {p[1]} | {f[3]:.0f} |")
steps = sorted(full)
rel = lambda a, b: abs(a - b) / abs(b)
if resumed:
    print("max rel |resumed - full| over steps 9-12:", max(rel(resumed[s][0], full[s][0]) for s in steps if s > 8))
if plain:
    print("max rel |plain - full| over all steps:", max(rel(plain[s][0], full[s][0]) for s in steps))
PY
[ -n "${MODEL_TESTS:-}" ] && python -m pytest -q -m gpu tests/model 2>&1 | tail -3 | tee -a "$S"
