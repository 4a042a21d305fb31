# flow: the product end to end on one GPU, through the design card's command (DeepSpeed's launcher over a
# localhost hostfile). A 2-layer llmjp3-1.8b (LLM-jp-3's layer shape and vocabulary) on the bundled corpus, BF16
# then FP8 delayed from step 6 (calibrated on the two steps before), 40 steps:
#   uninterrupted  the whole run;
#   sigterm        the same command, SIGTERM to the launcher's pid alone after step 8: the trainer saves and
#                  exits, and no process of the job is left;
#   resumed        the same command again: it resumes from that checkpoint and ends at step 40;
#   trail          the resumed run's losses, grad norms and phases against the uninterrupted run's, the flip at
#                  step 6 in both (resume_summary.py);
#   export-resumed its checkpoint as a Hugging Face model (the export reloads it and compares the logits);
#   generate       AutoModelForCausalLM + AutoTokenizer load the export and continue four prompts.
LAUNCHER=deepspeed
COMMON=(--preset llmjp3-1.8b --set model.backend=te --set "model.overrides={num_layers: 2}"
        --set logging.wandb=disabled --set train.global_batch_size=8 --set train.micro_batch_size=2
        --set train.steps=40 --set optim.warmup_steps=2 --set train.eval_interval=0 --set checkpoint.interval=0
        --set checkpoint.save_at_end=false --set precision.log_amax=true
        --set "$(fp8_from 6)")
train uninterrupted 1
interrupt resumed 1 8 TERM
launcher=$?
gone resumed 120
left_over=$?
saved sigterm resumed "$left_over" "launcher exit $launcher"
train resumed 1
trail trail uninterrupted resumed --flip 6
export_run resumed
logged generate 300 python -c 'import sys; from llmjp_ds.demo import generate_samples
for text in generate_samples(sys.argv[1]): print(text.replace("\n", " / "))' "$WORK/hf/resumed"
rc=$?
dry || grep -v '^+ ' "$LOGS/generate.log" | sed 's/^/  /' | note
verdict generate "$rc" "(llmjp_ds.demo.generate_samples)"
