# parity: Megatron-LM's own training loop and ours on one GPU, side by side (benchmarks/parity/__main__.py): the
# whole llmjp3-1.8b from one initialisation on the same batches, 500 steps in BF16; both restarted or imported at
# step 250 in FP8 delayed scaling; a Megatron checkpoint imported and continued here. Each gap is put beside
# Megatron against itself. Needs a Megatron-LM checkout at core_v0.19 (MEGATRON_LM, default .megatron-lm: its
# pretrain_gpt.py, gpt_builders.py, model_provider.py) and the LLM-jp v3 tokenizer (TOKENIZER, default
# .cache/tokenizer-v3.model). ARGS: more `python -m benchmarks.parity` arguments (--steps, --flip, --only ...).
# All of it takes ~24 minutes (two runs share the GPU at a time): BUDGET_S=1500; within 10-minute calls, several
# calls with --only (docs/device-checks.md).
# --recipe: LLM-jp-4's recipe instead, 140 steps of a batch growing from 1 to 4 sequences (Megatron's
# --step-batch-size-schedule, counted in samples): a stable WSD run (W-A1 to step 40 and W-A2 on, W-B, ours-wsd)
# and a decay branch from W-A1's checkpoint on another blend (D1, D2; import-w, branch, ours-decay). Two calls:
#   --recipe --only W-A1,W-B,ours-wsd,W-A2                  ~7 minutes
#   --recipe --only W-A1,D1,import-w,branch,ours-decay,D2   ~8 minutes
# --moe: the MoE check instead (benchmarks/parity/moe.py: parity-moe, 32 experts top-8 with qk-norm and the aux and
# z losses, 300 steps of 4 x 2048 tokens): Megatron-LM's A and B (B without its MoE fusions), each saved at 150
# and resumed, and its FP8 restarts from both checkpoints, beside ours in BF16 and ours flipping to FP8 at 151; up
# to six runs share the GPU. One call, 8.5 minutes (run AJ):
#   BUDGET_S=570 bash benchmarks/device/run.sh parity --no-fixtures --moe
# and the FP8 half alone, from A's checkpoint: Megatron's FP8 restart fused and not, ours importing that checkpoint
#   BUDGET_S=570 bash benchmarks/device/run.sh parity --no-fixtures --moe --only M-A1,M-FA,M-FAu,import-moe,ours-moe-fp8-a
# the device kit's megatron-core wheel ships its compiled dataset helpers but not the Makefile pretrain_gpt.py runs
# make with on rank 0: an empty one there (a Megatron-LM checkout has its own)
site=$(python -c 'import megatron.core.datasets as d, os; print(os.path.dirname(d.__file__))' 2>/dev/null)
if ! dry && [ -n "$site" ] && ls "$site"/helpers_cpp*.so >/dev/null 2>&1 && [ ! -f "$site/Makefile" ]; then
  printf 'default:\n\t@true\n' > "$site/Makefile"
fi
logged parity "$(left)" python -m benchmarks.parity --megatron-lm "${MEGATRON_LM:-.megatron-lm}" \
  --tokenizer "${TOKENIZER:-.cache/tokenizer-v3.model}" --out "$OUT" --budget-s $(( $(left) - 30 )) "$@"
rc=$?
dry || sed -n '/^| comparison/,/^$/p' "$OUT/summary-parity.md" 2>/dev/null | note
verdict parity "$rc" "(the gaps and the figures in \$OUT/summary-parity.md, parity-bf16.png, -fp8.png, \
-roundtrip.png; with --recipe parity-wsd.png, -decay.png; with --moe parity-moe-bf16.png, -moe-fp8.png, \
-moe-fp8-a.png, -moe-router.png)"
