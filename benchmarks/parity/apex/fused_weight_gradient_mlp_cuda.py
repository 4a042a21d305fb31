"""apex's fused weight-gradient accumulation, for Megatron-LM's own linear layers where apex is not installed:
the directory of this file goes on ``pretrain_gpt.py``'s PYTHONPATH (llmjp_ds/bench/peers.py says what it does)."""

from llmjp_ds.bench.peers import wgrad_gemm_accum_fp32

wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32
