# bench: ours against Megatron-Core 0.19.2 at its best single-GPU settings (peer-mcore-*; docs/performance.md
# says which), BF16 and FP8 delayed, at the 172B layer shape (172b-slice) and the whole llmjp3-1.8b: one
# `llmjp-ds bench` call, each variant in a fresh process, GAS 8, 3 timed steps. ARGS: more `llmjp-ds bench`
# arguments; a --shapes, --variants or --steps among them replaces the one here.
bench bench --shapes 172b-slice,llmjp3-1.8b --steps 3 --warmup 2 \
  --variants ours-bf16,peer-mcore-bf16,ours-fp8-delayed,peer-mcore-fp8-param "$@"
