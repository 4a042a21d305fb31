#!/usr/bin/env bash
# The GPU checks of llmjp-ds, one entry point (docs/device-checks.md says what each prints):
#   bash benchmarks/device/run.sh                      # the checks, one line each
#   bash benchmarks/device/run.sh CHECK [ARGS ...]     # one check; ARGS as its file says
#   bash benchmarks/device/run.sh --dry-run CHECK      # the commands it would run, running nothing
# A check writes its verdicts to $OUT/summary.md as it goes (OUT defaults to /tmp/out) and its logs to
# $OUT/CHECK.tgz, ends by BUDGET_S seconds (default: twice its minutes, at most 570), and exits non-zero when a
# stage failed. On the project's device machine, `source .whl/env.sh` first.
# A check is its file checks/NAME.sh (sourced after lib.sh, ARGS as "$@") and its line here.
CHECKS=(
  # name    minutes on one H200, GPUs it needs, what it checks
  "gpu-tests 2 1 every GPU test of this build (pytest -m gpu tests)"
  "bench     7 1 ours against Megatron-Core at 172b-slice, llmjp3-1.8b (BF16, FP8), llmjp4-8b-slice (BF16), one call"
  "flow      4 1 the design card's launcher: train, flip to FP8, SIGTERM, resume as if uninterrupted, export, generate"
  "kernels   5 1 the fused kernels: their GPU tests, their bandwidth, the 1.8B step with them and without"
  "async     6 1 background checkpoints of the whole 1.8B: each save's stall, a kill -9 mid-write, the resume"
  "cluster   3 1 mpirun, a rank per GPU: each rank's place, the flip, SIGUSR1 saves, the relaunch resumes"
  "multi     8 2 ZeRO-1/3, pipeline, tensor parallel on every GPU against one GPU through the flip; resume, export"
  "parity    24 1 Megatron-LM and ours from one init on the same batches: 500 steps BF16, FP8 from 250, a round trip"
  "moe       7 1 LLM-jp-4's MoE: its GPU tests, the flip, SIGTERM, resume, the qwen3_moe export, generate"
  "health    6 1 a loss spike from an LR spike on the whole 1.8B: rolled back beside the same run left to it"
)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
DRY=0
[ "${1:-}" = --dry-run ] && { DRY=1; shift; }
CHECK=${1:---list}
shift $(( $# > 0 ))
if [ "$CHECK" = --list ]; then
  echo "bash benchmarks/device/run.sh [--dry-run] CHECK [ARGS]; the checks (minutes on one H200, GPUs):"
  for line in "${CHECKS[@]}"; do
    read -r name minutes gpus what <<< "$line"
    printf '  %-10s %2s min, %s GPU  %s\n' "$name" "$minutes" "$gpus" "$what"
  done
  exit 0
fi
line=$(printf '%s\n' "${CHECKS[@]}" | grep -m1 "^$CHECK ") || {
  echo "error: no check named '$CHECK': run \`bash benchmarks/device/run.sh\` for the list" >&2; exit 2; }
read -r _ MINUTES NEED _ <<< "$line"
BUDGET_S=${BUDGET_S:-$(( MINUTES * 120 < 570 ? MINUTES * 120 : 570 ))}
source benchmarks/device/lib.sh
begin
# shellcheck source=/dev/null
source "benchmarks/device/checks/$CHECK.sh" "$@"
end
