#!/bin/bash
# llmjp-ds under SGE / Univa (ABCI's qsub) or PBS: the job's hosts, from $PE_HOSTFILE or $PBS_NODEFILE, become a
# DeepSpeed hostfile (`llmjp-ds preflight --write-hostfile`, which also checks the run config for that world), then
# the deepspeed launcher starts a rank per slot over pdsh + ssh (passwordless ssh between the job's nodes; the
# environment reaches the other nodes through .deepspeed_env, see hostfiles/h100). Submit from the repository
# checkout, with the Python environment active:
#
#   qsub -g GROUP -l rt_F=2 -l h_rt=10:00:00 hostfiles/sge-pbs.sh --config run.yaml [--set key=value ...]  # ABCI
#   qsub -l select=2:ngpus=8 -V -v LLMJP_DS_ARGS="--config run.yaml" hostfiles/sge-pbs.sh                  # PBS Pro
#
# (PBS passes no arguments to a job script: give them in LLMJP_DS_ARGS; Torque also takes qsub -F "ARGS".)
# Slots per host: GPUS_PER_NODE if set, else the GPUs nvidia-smi lists, else the scheduler's own count (SGE's
# slots are often CPU cores: on a CPU-only queue set GPUS_PER_NODE to the ranks you want per host).
#
# Preemption: the trainer saves a checkpoint and exits 0 on SIGTERM or SIGINT. PBS's qdel and walltime send
# SIGTERM, then SIGKILL after kill_delay; SGE ends a job at h_rt with SIGKILL (with -notify it sends SIGUSR2
# first, which the trainer does not catch): keep checkpoint.interval short there, and resubmit to resume.
#$ -cwd
#$ -j y
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-${SGE_O_WORKDIR:-.}}"
if [ "$#" -eq 0 ] && [ -n "${LLMJP_DS_ARGS:-}" ]; then
    read -r -a args <<< "$LLMJP_DS_ARGS"  # split on blanks, never evaluated: no quotes inside the arguments
    set -- "${args[@]}"
fi

slots=${GPUS_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}
hostfile=${LLMJP_DS_HOSTFILE:-hostfile.${JOB_ID:-${PBS_JOBID:-$$}}}
if [ "${slots:-0}" -gt 0 ]; then
    llmjp-ds preflight --write-hostfile "$hostfile" --slots "$slots" "$@"
else
    llmjp-ds preflight --write-hostfile "$hostfile" "$@"
fi
exec deepspeed --hostfile "$hostfile" llmjp_ds/train.py "$@"
