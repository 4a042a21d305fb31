# health: a loss spike from a real cause on the whole llmjp3-1.8b, handled by a rollback, beside the same run left
# to it. The blend is real text (three corpora of the machine's Python sources, benchmarks/real_text_corpus.py,
# tokenized with the LLM-jp v3 tokenizer: TOKENIZER, default .cache/tokenizer-v3.model), 120 steps of 8 sequences,
# warm-up 20, cosine to step 120. At steps 61 and 62 the LR is 50 times the schedule's (LLMJP_DS_DRILL_SPIKE_ON=lr:
# the optimizer really takes those steps), so the loss from step 62 on jumps:
#   handled    health.loss.action=rollback: detected at step 62 (the progress line's step 62), back to the checkpoint
#              of step 60 (saves every 20 steps, one kept: a 1.8B checkpoint is 25 GB on the H200 machine's 64 GB
#              disk, and a save writes beside the one kept), steps 61-62 skipped; `llmjp-ds health` lists it and
#              draws it;
#   unhandled  health.loss.action=warn: the same spike, left to the optimizer;
#   figure     the handled run's loss beside the unhandled one's (llmjp-ds plot --beside): spike-handled.png.
# ARGS: more --set values for both runs.
corpus=$WORK/corpus
if ! dry; then
  python benchmarks/real_text_corpus.py --output-dir "$corpus" --tokenizer "${TOKENIZER:-.cache/tokenizer-v3.model}" \
    --megabytes "${MEGABYTES:-24}" --parts 3 > "$LOGS/corpus.log" 2>&1 || { say "corpus: FAIL (see $LOGS/corpus.log)"; exit 1; }
fi
COMMON=(--preset llmjp3-1.8b --set model.backend=te --set logging.wandb=disabled
        --set "data.blend=[0.5, $corpus/python-1_text_document, 0.3, $corpus/python-2_text_document, 0.2, $corpus/python-3_text_document]"
        --set "data.tokenizer=${TOKENIZER:-.cache/tokenizer-v3.model}" --set data.order=llmjp --set "data.split=[99, 1]"
        --set train.global_batch_size=8 --set train.micro_batch_size=2 --set train.steps=120 --set train.eval_interval=0
        --set optim.warmup_steps=20 --set optim.decay_steps=120 --set health.window=40
        --set checkpoint.interval=20 --set checkpoint.keep_last=1 --set checkpoint.save_at_end=false "$@")
export LLMJP_DS_DRILL_SPIKE_STEPS=61,62 LLMJP_DS_DRILL_SPIKE_ON=lr LLMJP_DS_DRILL_SPIKE_SCALE=50
# both at once on the GPU (~48 GiB each at this batch)
start handled 1 --set health.loss.action=rollback
handled=$JOB
start unhandled 1 --set health.loss.action=warn --set checkpoint.interval=0
await unhandled
verdict unhandled $? "$(dry || grep -E '^step +[0-9]+/|^error' "$LOGS/unhandled.log" | tail -1)"
JOB=$handled
await handled
verdict handled $? "$(dry || grep -E '^step +[0-9]+/|^error|rolled back' "$LOGS/handled.log" | tail -2 | tr '\n' ' ')"
unset LLMJP_DS_DRILL_SPIKE_STEPS LLMJP_DS_DRILL_SPIKE_ON LLMJP_DS_DRILL_SPIKE_SCALE
logged report 120 python -m llmjp_ds.cli health "$R/handled" --plot "$OUT/health-handled.png"
rc=$?
dry || grep -E '^\||steps logged' "$LOGS/report.log" | note
verdict report "$rc" "(llmjp-ds health handled --plot)"
logged figure 120 python -m llmjp_ds.cli plot "$R/handled" --beside "$R/unhandled" --output "$OUT/spike-handled.png"
verdict figure $? "$(dry || tail -1 "$LOGS/figure.log")"
