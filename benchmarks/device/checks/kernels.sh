# kernels: the fused kernels of llmjp_ds/model/kernels (RoPE in place, the streaming loss, the one-pass AdamW):
# their GPU tests, their bandwidth against the paths they replace (kernel_bandwidth.py), and the 1.8B step with
# every fused path at its default against every one off (TE's QKV RoPE, the compiled loss, DeepSpeed's optimizer
# step, autograd's residual add), in the same call. ARGS: more `llmjp-ds bench` arguments for both.
gpu_tests kernel-tests tests/model/test_kernel_rope.py tests/model/test_kernel_cross_entropy.py \
  tests/model/test_kernel_adamw.py
logged bandwidth 180 python benchmarks/device/kernel_bandwidth.py --kernels rope,loss,adamw \
  --json "$LOGS/bandwidth.json"
rc=$?
dry || grep "^|" "$LOGS/bandwidth.log" | note
verdict bandwidth "$rc" "(kernel_bandwidth.py)"
B=(--shapes llmjp3-1.8b --steps 3 --warmup 2 --variants "ours-bf16,ours-fp8-delayed" "$@")
bench kernels-on "${B[@]}"
bench kernels-off LLMJP_DS_FUSED_LOSS=compiled "${B[@]}" --set model.fused_qkv_rope=te \
  --set optim.fused_step=false --set model.fused_residual_norm=false
