#!/bin/bash
# llmjp-ds under Grid Engine (SGE, Univa/Altair GE; ABCI 2.0's and TSUBAME's qsub) or PBS Pro (ABCI 3.0): the job's
# hosts, from $PE_HOSTFILE or $PBS_NODEFILE, become a hostfile (`llmjp-ds preflight --write-hostfile`, which also
# checks the run config for that world), then Open MPI's mpirun starts a rank per slot over ssh, as LLM-jp's ABCI
# scripts did. Each rank reads its place from OMPI_COMM_WORLD_* (llmjp_ds/launch/scheduler.py) and rendezvous at
# the first host on port 10000 + job id % 50000. Submit from the repository checkout, with the Python environment
# active (-V exports it to the job), and passwordless ssh between the job's hosts:
#
#   qsub -V -pe PE 16 hostfiles/sge-pbs.sh --config run.yaml [--set key=value ...]    # Grid Engine, PE with
#                                                                                      #   allocation_rule $round_robin
#   qsub -g GROUP -l rt_F=2 -l h_rt=10:00:00 hostfiles/sge-pbs.sh --config run.yaml   # ABCI 2.0
#   qsub -P GROUP -q rt_HF -l select=2 -l walltime=10:00:00 -V \
#        -v LLMJP_DS_ARGS="--config run.yaml" hostfiles/sge-pbs.sh                      # ABCI 3.0 (PBS Pro)
#
# PBS passes no arguments to a job script: give them in LLMJP_DS_ARGS (Torque also takes qsub -F "ARGS"). Under PBS
# Pro the hostfile lists each host once per MPI process of its select chunk (mpiprocs), as ABCI 3.0's
# `mpirun -hostfile $PBS_NODEFILE` reads it. Slots per host: GPUS_PER_NODE if set, else the GPUs nvidia-smi lists,
# else the scheduler's own count (SGE's slots are often CPU cores: on a CPU-only queue set GPUS_PER_NODE to the
# ranks you want per host). The same hostfile serves `deepspeed --hostfile "$hostfile" llmjp_ds/train.py ...`.
#
# mpirun reaches the other hosts over ssh, not through Grid Engine's `qrsh -inherit` (plm_rsh_disable_qrsh): on
# Grid Engine 8.1.9 a rescheduled job (`qmod -rj`) whose ranks ran under qrsh stayed stuck in transfer. The PE then
# needs no control_slaves. A host lost mid-run (dead, or its link down) ends the job in
# parallel.heartbeat_timeout_s with one line naming it: the rank on this host ends mpirun, which would otherwise
# wait for the silent host's daemon as long as TCP retransmits.
#
# Preemption and rescheduling. Under Grid Engine this script asks for -notify and -r y: before it kills the job
# (qdel, `qmod -rj` to reschedule it, a suspension), Grid Engine sends SIGUSR2 and waits the queue's `notify`
# time. The trap forwards SIGUSR2 to mpirun, which forwards it to every rank (Open MPI forwards SIGUSR1 and
# SIGUSR2; this script adds SIGUSR2 to checkpoint.stop_signals); the ranks save at one step boundary and exit 0,
# and the script exits 99, which Grid Engine answers by queueing the job again: the rerun resumes from `latest`.
# A deleted job is not rerun. Keep the queue's notify time above checkpoint.grace_seconds. PBS's qdel and walltime
# send SIGTERM to the job's processes, then SIGKILL after kill_delay; the trap forwards SIGTERM as SIGUSR2 too.
# Open MPI's odls_base_sigkill_timeout stays at its 1 s (unlike hostfiles/slurm-mpirun.sbatch): mpirun, ending a
# job, sleeps that long after its SIGTERM to the ranks whatever they do, so a large value keeps a failed job alive.
#$ -cwd
#$ -j y
#$ -notify
#$ -r y
#PBS -j oe
#PBS -r y
set -euo pipefail
cd "${PBS_O_WORKDIR:-${SGE_O_WORKDIR:-.}}"
if [ "$#" -eq 0 ] && [ -n "${LLMJP_DS_ARGS:-}" ]; then
    read -r -a args <<< "$LLMJP_DS_ARGS"  # split on blanks, never evaluated: no quotes inside the arguments
    set -- "${args[@]}"
fi
job=${JOB_ID:-${PBS_JOBID:-$$}}
job=${job%%.*}  # PBS: 1234.server

slots=${GPUS_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}
hostfile=${LLMJP_DS_HOSTFILE:-hostfile.$job}
if [ "${slots:-0}" -gt 0 ]; then
    llmjp-ds preflight --write-hostfile "$hostfile" --slots "$slots" "$@"
else
    llmjp-ds preflight --write-hostfile "$hostfile" "$@"
fi
hosts=$(awk 'NF && $1 !~ /^#/ {printf "%s ", $1}' "$hostfile")
MASTER_ADDR=${hosts%% *}  # the first host
MASTER_PORT=$((10000 + job % 50000))
ranks=$(awk -F'slots=' 'NF > 1 {n += $2} END {print n}' "$hostfile")
export MASTER_ADDR MASTER_PORT
echo "llmjp-ds: job $job: $ranks ranks on ${hosts}master $MASTER_ADDR:$MASTER_PORT"

command -v mpirun >/dev/null || { echo "error: mpirun is not on PATH: install Open MPI (apt install openmpi-bin) or load its module, then submit again" >&2; exit 1; }
# ssh gives the other hosts' ranks only what -x names: PATH and the rendezvous, and the variables a training reads
# there, by prefix, as DeepSpeed's launcher forwards NCCL_*, PYTHON* and UCX_* (GLOO_SOCKET_IFNAME: the twin of
# NCCL_SOCKET_IFNAME the trainer reads as well; TORCH_EXTENSIONS_DIR: the build of DeepSpeed's ops this job's
# environment already has; NVTE_*, PYTORCH_* and CUDA_DEVICE_MAX_CONNECTIONS: Transformer Engine's switches, the
# caching allocator's settings and the stream count the kernels' overlap needs, which must be equal on every rank).
# Not CUDA_VISIBLE_DEVICES: each host has its own.
forward=(-x MASTER_ADDR -x MASTER_PORT -x PATH -x LD_LIBRARY_PATH)
for name in $(compgen -e); do
    case "$name" in
        NCCL_* | GLOO_* | UCX_* | PYTHON* | TORCH_* | OMP_NUM_THREADS | HF_* | TRANSFORMERS_* | TOKENIZERS_* \
            | LLMJP_DS_* | NVTE_* | PYTORCH_* | CUDA_DEVICE_MAX_CONNECTIONS) forward+=(-x "$name") ;;
    esac
done
stopped=0
# $!, not $pid: a signal that comes as mpirun starts runs the trap before `pid=$!` does
trap 'stopped=1; kill -USR2 $! 2>/dev/null || true' USR2 TERM
mpirun -np "$ranks" --hostfile "$hostfile" -bind-to none -map-by slot -mca plm_rsh_disable_qrsh 1 \
    "${forward[@]}" python -m llmjp_ds.train --set 'checkpoint.stop_signals=[SIGTERM,SIGINT,SIGUSR2]' "$@" &
pid=$!
status=0
wait "$pid" || status=$?
if [ "$stopped" = 1 ]; then  # the trap cut `wait` short: let the ranks finish their save
    status=0
    wait "$pid" || status=$?
    if [ "$status" = 0 ] && [ -n "${SGE_ROOT:-}" ]; then
        exit 99  # Grid Engine queues the job again (not a deleted one); its rerun resumes from `latest`
    fi
fi
exit "$status"
