# cluster: the GPU side of a scheduler launch. Open MPI's mpirun (as LLM-jp launched its 172B) starts a rank per
# GPU; each takes its place from OMPI_COMM_WORLD_* and its GPU from its local rank (place: preflight under
# mpirun). A 4-layer llmjp3-1.8b, BF16 then FP8 delayed from step 4, 12 steps uninterrupted; the same command
# with SIGUSR1 to mpirun after step 7 (what hostfiles/slurm-mpirun.sbatch's trap does before the time limit;
# Open MPI forwards it to the ranks), which must save and exit 0; the same command again, which must resume and
# repeat the uninterrupted trail.
LAUNCHER=mpirun
COMMON=(--preset llmjp3-1.8b --set "model.overrides={num_layers: 4}" --set model.backend=te
        --set logging.wandb=disabled --set train.global_batch_size=$(( 16 * NGPU )) --set train.micro_batch_size=2
        --set train.steps=12 --set train.eval_interval=0 --set checkpoint.interval=0
        --set checkpoint.save_at_end=false --set "checkpoint.stop_signals=[SIGTERM, SIGINT, SIGUSR1]"
        --set "$(fp8_from 4)")
mpi "$NGPU" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29499
logged place 120 "${MPI[@]}" python -m llmjp_ds.cli preflight --hostfile hostfiles/localhost
rc=$?
dry || grep -hE "^launch|^error" "$LOGS/place.log" | sort -u | note
verdict place "$rc" "(llmjp-ds preflight under mpirun)"
train uninterrupted "$NGPU"
interrupt stopped "$NGPU" 7 USR1
rc=$?
saved sigusr1 stopped "$rc" "mpirun exit $rc"
train stopped "$NGPU"
trail trail uninterrupted stopped --flip 4
