# async: background checkpoints on the whole llmjp3-1.8b (the bundled corpus, BF16, global batch 16, micro-batch
# 2; ~25 GB a checkpoint, which this disk writes in ~25 s). The disk's speed; 20 steps saving every 6 in the
# background (async-saves: each save's stall, the steps run during a write, the advice when a save waits for the
# one before); then the same run killed (-9) at step 14, step 12's write in flight, and launched again: it must
# resume from the last complete checkpoint and repeat the uninterrupted run's trail.
COMMON=(--preset llmjp3-1.8b --set model.backend=te --set logging.wandb=disabled --set train.global_batch_size=16
        --set train.micro_batch_size=2 --set train.steps=20 --set checkpoint.interval=6 --set checkpoint.keep_last=1
        --set checkpoint.save_at_end=false --set train.eval_interval=0 --set checkpoint.async_save=true)
logged disk 120 dd if=/dev/zero of="$WORK/ddtest" bs=1M count=8192 conv=fdatasync
verdict disk $? "(8 GiB written with fdatasync: $(dry || tail -1 "$LOGS/disk.log"))"
dry || rm -f "$WORK/ddtest"
train uninterrupted 1
logged async-saves 60 python benchmarks/device/async_summary.py "$R/uninterrupted"
rc=$?
dry || grep -hE "^save|^no write|^during|^warning" "$LOGS/async-saves.log" "$LOGS/uninterrupted.log" | note
verdict async-saves "$rc" "(async_summary.py)"
dry || rm -rf "$R/uninterrupted/checkpoints"  # 25 GB the disk needs for the next run
interrupt killed 1 14 KILL
dry || say "killed: latest $(cat "$R/killed/checkpoints/latest"); tags $(cd "$R/killed/checkpoints" && echo step*)"
train killed 1
trail trail uninterrupted killed
