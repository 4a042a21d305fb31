# The shell the device checks share (run.sh sources it, then checks/NAME.sh): where files go, the time left,
# verdicts, and the commands the checks run, each of which prints itself instead under --dry-run.
# From run.sh: CHECK, DRY, BUDGET_S, NEED (GPUs). From the environment: OUT (what comes back; /tmp/out), NGPU
# (default: the GPUs nvidia-smi lists), EXTRA (more arguments for every training; a rehearsal on CPUs:
# NGPU=1 EXTRA="--set model.backend=torch --set precision.emulate_fp8=true --set data.seq_len=128 ...").
OUT=${OUT:-/tmp/out}
S=$OUT/summary.md
WORK=/tmp/llmjp-ds-checks/$CHECK
R=$WORK/runs
LOGS=$WORK/logs
DEADLINE=$(( $(date +%s) + BUDGET_S ))
PASSED=0
FAILED=0
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
export LLMJP_DS_CACHE=$PWD/.cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TORCH_EXTENSIONS_DIR=/tmp/torch_ext \
  TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
[ -d /tmp/site/bin ] && export PATH=/tmp/site/bin:$PATH  # the deepspeed launcher of the device kit's wheel

dry() { [ "$DRY" = 1 ]; }
say() { echo "$*" | tee -a "$S"; }
note() { tee -a "$S"; }  # lines from stdin to the summary
left() { echo $(( DEADLINE - $(date +%s) )); }
show() {  # a command as a shell reads it
  local arg line=+
  for arg; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then line+=" $arg"; else line+=" '${arg//\'/\'\\\'\'}'"; fi
  done
  echo "$line"
}

begin() {
  if dry; then (( NGPU > 0 )) || NGPU=$NEED; echo "# $CHECK on $NGPU GPU(s), dry run: what it would run"; return; fi
  (( NGPU >= NEED )) || { echo "error: $CHECK needs $NEED GPUs, this machine has $NGPU (NGPU)" >&2; exit 2; }
  mkdir -p "$OUT"
  rm -rf "$WORK"  # a warm machine keeps /tmp, an earlier check's checkpoints too
  mkdir -p "$R" "$LOGS"
  trap pack EXIT
  local gpu free
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  free=$(df -h --output=avail /tmp | tail -1 | tr -d ' ')
  say "## $CHECK ($(date +%T); $NGPU x ${gpu:-no GPU}; budget $BUDGET_S s; /tmp free $free)"
}

end() {
  dry && return 0
  say "$CHECK: $PASSED passed, $FAILED failed in $(( BUDGET_S - $(left) )) s"
  exit $(( FAILED > 0 ))
}

pack() {  # the logs and every run's metrics back in $OUT; nothing of the check outlives it, nor its checkpoints
  for pid in $(pgrep -f "run_dir=$R/"); do kill -KILL "$pid" 2>/dev/null; done
  tar czf "$OUT/$CHECK.tgz" -C "$WORK" --exclude=checkpoints --exclude=tokenizer logs runs
  rm -rf "$R"/*/checkpoints "$WORK/hf"
}

# fp8_from STEP: the precision schedule of the checks that flip: BF16, then FP8 delayed scaling (hybrid, amax history
# 16) from STEP, calibrated on the two steps before
fp8_from() {
  echo "precision.phases=[{precision: bf16}, {precision: fp8, start_step: $1, recipe: delayed, fp8_format: hybrid," \
    "amax_history_len: 16, calibration_steps: 2}]"
}

# verdict STAGE RC WHAT: a line of the summary, PASS when RC is 0
verdict() {
  if dry; then echo "  => verdict $1"; return 0; fi
  if [ "$2" = 0 ]; then PASSED=$((PASSED + 1)); say "$CHECK $1: PASS $3"
  else FAILED=$((FAILED + 1)); say "$CHECK $1: FAIL (exit $2) $3"; fi
}

# logged NAME LIMIT CMD ...: CMD for at most LIMIT seconds (and the check's time left), its output appended to
# $LOGS/NAME.log; its exit status (124: out of time)
logged() {
  local name=$1 limit=$2
  shift 2
  if dry; then show "$@"; return 0; fi
  (( limit > $(left) )) && limit=$(left)
  (( limit > 5 )) || { say "$name: not run, the check's BUDGET_S is spent"; return 124; }
  echo "+ $(date +%T) ${*//$'\n'/ }" >> "$LOGS/$name.log"
  timeout "$limit" "$@" >> "$LOGS/$name.log" 2>&1
}

# gpu_tests NAME ARGS ...: pytest -m gpu ARGS, its last lines in the summary
gpu_tests() {
  local name=$1
  shift
  logged "$name" "$(left)" python -m pytest -m gpu -q -p no:cacheprovider "$@"
  local rc=$?
  dry || grep -E "^[0-9]+ (passed|failed|skipped|deselected)|^(FAILED|ERROR) |^error" "$LOGS/$name.log" | tail -5 | note
  verdict "$name" "$rc" "(pytest -m gpu $*)"
}

# bench NAME [VAR=VALUE ...] ARGS ...: `llmjp-ds bench ARGS` in that environment, its JSON in $OUT/NAME.json and
# its tables in the summary
bench() {
  local name=$1 envs=()
  shift
  while [[ ${1:-} == [A-Z]*=* ]]; do envs+=("$1"); shift; done
  logged "$name" "$(left)" env "${envs[@]}" python -m llmjp_ds.cli bench "$@" --json "$OUT/$name.json"
  local rc=$?
  dry || grep -E "^\||^profile|^host|^GPU|^error" "$LOGS/$name.log" | note
  verdict "$name" "$rc" "(${envs[*]:+${envs[*]} }llmjp-ds bench $*)"
}

# start NAME GPUS [ARGS ...]: the training of "${COMMON[@]}" ARGS into $R/NAME in the background, its output
# appended to $LOGS/NAME.log and its pid in JOB, launched by $LAUNCHER:
#   deepspeed  the design card's command: DeepSpeed's launcher over a localhost hostfile of GPUS slots
#   mpirun     Open MPI, a rank per GPU, each taking its place from OMPI_COMM_WORLD_* (as under Slurm)
#   python     one process on GPU 0
start() {
  local name=$1 gpus=$2 port=$(( 29500 + RANDOM % 500 )) cmd
  shift 2
  case ${LAUNCHER:-python} in
    deepspeed) cmd=(deepspeed --hostfile "$WORK/hostfile-$gpus" --no_ssh_check --master_addr 127.0.0.1
                    --master_port "$port" llmjp_ds/train.py) ;;
    mpirun) mpi "$gpus" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port"; cmd=("${MPI[@]}" python -m llmjp_ds.train) ;;
    python) cmd=(env CUDA_VISIBLE_DEVICES=0 python -m llmjp_ds.train) ;;
  esac
  cmd+=("${COMMON[@]}" --set "run_dir=$R/$name" "$@" "${EXTRA_ARGS[@]}")
  JOB=0
  if dry; then show "${cmd[@]}"; echo "  (in the background: $name)"; return 0; fi
  echo "localhost slots=$gpus" > "$WORK/hostfile-$gpus"
  echo "+ $(date +%T) ${cmd[*]}" >> "$LOGS/$name.log"
  "${cmd[@]}" >> "$LOGS/$name.log" 2>&1 &
  JOB=$!
}

# mpi N [ARGS ...]: MPI=(mpirun with N ranks on this host, passing on the environment a rank needs, ARGS)
mpi() {
  MPI=(mpirun -np "$1" --bind-to none "${@:2}")
  for var in PATH PYTHONPATH LD_LIBRARY_PATH LLMJP_DS_CACHE TORCH_EXTENSIONS_DIR TORCH_CUDA_ARCH_LIST \
      PYTHONUNBUFFERED NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS; do
    [ -n "${!var:-}" ] && MPI+=(-x "$var")
  done
}

# await NAME: wait for the job started last (ended at the check's deadline); its exit status
await() {
  dry && { echo "+ wait for $1"; return 0; }
  while kill -0 "$JOB" 2>/dev/null && (( $(left) > 0 )); do sleep 1; done
  kill -0 "$JOB" 2>/dev/null && { say "$1: still running at the check's deadline, ended"; kill -KILL "$JOB"; }
  { wait "$JOB"; } 2> /dev/null  # no job-control notice of a kill in the output
}

# train NAME GPUS [ARGS ...]: start, await, and the verdict with the last step's line
train() {
  start "$@"
  await "$1"
  local rc=$?
  verdict "$1" "$rc" "$(dry || grep -E '^step +[0-9]+/|^error' "$LOGS/$1.log" | tail -1)"
}

# at_step NAME STEP: wait until NAME's log shows STEP (fails if its job ends first or the time is up)
at_step() {
  dry && { echo "+ wait until $1's log shows step $2"; return 0; }
  until grep -qE "^step +$2/" "$LOGS/$1.log" 2>/dev/null; do
    kill -0 "$JOB" 2>/dev/null && (( $(left) > 0 )) || return 1
    sleep 0.2
  done
}

# signal SIG NAME: SIG to the pid started last alone (a launcher, or the one process), as a scheduler does
signal() {
  dry && { echo "+ kill -$1 <the pid started for $2>"; return 0; }
  say "$2: SIG$1 to pid $JOB after $(grep -E '^step +[0-9]+/' "$LOGS/$2.log" | tail -1 | cut -d'|' -f1)"
  kill -"$1" "$JOB"
}

# gone NAME SECONDS: every process of NAME's job has ended within SECONDS (said in the summary)
gone() {
  dry && { echo "+ wait up to $2 s for every process of $1 to end"; return 0; }
  local waited=0
  while pgrep -f "run_dir=$R/$1( |\$)" > /dev/null; do
    (( waited++ < $2 )) || { say "$1: still running $2 s later: pids $(pgrep -f "run_dir=$R/$1( |\$)" | xargs)"
                             return 1; }
    sleep 1
  done
  say "$1: no process of the job left ${waited} s later"
}

# interrupt NAME GPUS STEP SIG: start NAME, SIG to its launcher once its log shows STEP; its exit status
interrupt() {
  start "$1" "$2"
  if at_step "$1" "$3"; then signal "$4" "$1"; else say "$1: never reached step $3"; fi
  await "$1"
}

# saved STAGE NAME RC WHAT: the verdict on a stop request: RC 0 and NAME's run saved (its `preempted` event and the
# tag `latest` names)
saved() {
  dry && { echo "+ read the preempted event and checkpoints/latest of $2"; verdict "$1"; return 0; }
  local event latest
  event=$(grep '"event": "preempted"' "$R/$2/metrics.jsonl" 2>/dev/null | tail -1)
  latest=$(cat "$R/$2/checkpoints/latest" 2>/dev/null)
  verdict "$1" $(( $3 || ! ${#event} || ! ${#latest} )) \
    "$4; saved: ${event:-no preempted event}; latest ${latest:-none}"
}

# trail STAGE UNINTERRUPTED RESUMED [ARGS ...]: resume_summary.py (step by step in its log, its findings in the
# summary) and its verdict
trail() {
  logged "$1" 120 python benchmarks/device/resume_summary.py "$R/$2" "$R/$3" "${@:4}"
  local rc=$?
  dry || grep -v -e '^|' -e '^+ ' "$LOGS/$1.log" | note
  verdict "$1" "$rc" "($3 against $2)"
}

# fork NAME FROM STEP: a new run dir holding FROM's checkpoint of STEP (hard links) as its latest; the resume
# drops FROM's metrics after STEP
fork() {
  local tag
  tag=$(printf "step%08d" "$3")
  dry && { echo "+ fork $1 from $2's $tag"; return 0; }
  mkdir -p "$R/$1/checkpoints" && cp -al "$R/$2/checkpoints/$tag" "$R/$1/checkpoints/" \
    && echo "$tag" > "$R/$1/checkpoints/latest" && cp -r "$R/$2/tokenizer" "$R/$2/metrics.jsonl" "$R/$1/"
}

# export_run NAME: NAME's latest checkpoint as a Hugging Face model in $WORK/hf/NAME, on the CPUs (the export's
# own check reloads it with transformers and compares the logits)
export_run() {
  logged "export-$1" 600 env CUDA_VISIBLE_DEVICES= python -m llmjp_ds.cli export --run "$R/$1" \
    --output "$WORK/hf/$1" --dtype bf16 --force
  local rc=$?
  verdict "export-$1" "$rc" "$(dry || tail -1 "$LOGS/export-$1.log")"
}
