# moe: LLM-jp-4's MoE on one GPU. Its GPU tests (TE's fused routing and permutation against the torch formulas,
# the TE model against its torch twin, an FP8 step, the experts' fp32 gradient accumulation); then a 2-layer
# llmjp4-32b-a3b at 32 experts (its layer otherwise, its head) on the bundled corpus, BF16 then FP8 delayed from
# step 9, 16 steps:
#   moe-uninterrupted  the whole run;
#   moe-sigterm        the same, SIGTERM after step 6: it saves and exits;
#   moe-resumed        the same command again, from that checkpoint to step 16;
#   moe-trail          the resumed run's losses, grad norms and phases against the uninterrupted run's;
#   export, generate   the qwen3_moe export (reloaded, logits compared) and AutoModelForCausalLM continuing prompts.
# The MoE's speed beside Megatron-Core's MoE is the bench check's, in a call of its own (docs/moe.md):
#   bash benchmarks/device/run.sh bench --shapes llmjp4-moe-slice \
#     --variants ours-bf16,peer-mcore-bf16,ours-fp8-delayed,peer-mcore-fp8-delayed
# ARGS: pytest's for the GPU tests (default: tests/model/test_moe.py).
gpu_tests moe-gpu-tests "${@:-tests/model/test_moe.py}"
LAUNCHER=python
COMMON=(--preset llmjp4-32b-a3b --set model.backend=te --set "model.overrides={num_layers: 2, num_experts: 32}"
        --set logging.wandb=disabled --set data.seq_len=2048 --set train.global_batch_size=8
        --set train.micro_batch_size=2 --set train.steps=16 --set optim.warmup_steps=2 --set optim.decay_steps=16
        --set checkpoint.interval=0 --set "checkpoint.keep=[]" --set checkpoint.save_at_end=false
        --set logging.expert_load_interval=1 --set "$(fp8_from 9)")
train moe-uninterrupted 1
interrupt moe-resumed 1 6 TERM
launcher=$?
gone moe-resumed 120
left_over=$?
saved moe-sigterm moe-resumed "$left_over" "exit $launcher"
train moe-resumed 1
trail moe-trail moe-uninterrupted moe-resumed --flip 9
export_run moe-resumed
logged generate 300 python -c 'import sys; from llmjp_ds.demo import generate_samples
for text in generate_samples(sys.argv[1]): print(text.replace("\n", " / "))' "$WORK/hf/moe-resumed"
rc=$?
dry || grep -v '^+ ' "$LOGS/generate.log" | sed 's/^/  /' | note
verdict generate "$rc" "(llmjp_ds.demo.generate_samples on the qwen3_moe export)"
