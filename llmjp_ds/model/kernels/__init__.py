"""Fused Triton kernels of the GPU path, each beside its PyTorch reference (the formula it must match).

Every kernel here is opt-in or opt-out by a ``model`` config field and runs only on CUDA tensors; the CPU
backend never imports Triton (``torch_layers`` keeps the plain formulas). Triton ships with CUDA builds of
torch, so the kernels need no extra dependency there. The ``*_triton`` modules hold the ``@triton.jit`` code
and are imported on first use.

* :mod:`~llmjp_ds.model.kernels.rope`: RoPE on the packed QKV projection output, in place
  (``model.fused_qkv_rope: triton``).
* :mod:`~llmjp_ds.model.kernels.cross_entropy`: cross-entropy + z-loss over bf16 logits, the gradient written
  over them (``model.fused_loss`` on CUDA).
"""
