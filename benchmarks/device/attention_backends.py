"""Causal attention forward and forward + backward at the bench shapes, through each backend the H200 image has:
TE's DotProductAttention (cuDNN) as the model calls it (Q, K, V as views of the packed QKV buffer, ``bshd``) and
on contiguous tensors (``bshd``, ``sbhd``), and torch's scaled_dot_product_attention with its cuDNN and flash
backends. Model TFLOP/s count the causal half: forward ``2 * 2 * b * s^2 * heads * d / 2``, backward 2.5x that.
Times: wall time over back-to-back calls (TE's host work per call included), and from the profiler the device
time of the attention kernels alone and of every other kernel the call runs (autograd's copies into a packed
gradient, for one).

    source .whl/env.sh && python benchmarks/device/attention_backends.py
"""

from __future__ import annotations

import torch
from kernel_bandwidth import loop_ms  # the same directory: wall time over back-to-back calls

SHAPES = {"llmjp3-1.8b": dict(b=2, s=4096, heads=16, kv=16, d=128),
          "172b-slice": dict(b=1, s=4096, heads=96, kv=16, d=128)}


def kernel_ms(fn, iters: int = 5) -> tuple[float, float]:
    """Device time per call of ``fn``'s attention kernels (cuDNN's or flash's) and of every other kernel it runs
    (autograd's copies and fills), from the profiler: no host time in either."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    attention = other = 0.0
    for event in prof.key_averages():
        us = event.self_device_time_total
        if any(key in event.key.lower() for key in ("sdpa", "fmha", "flash", "attn")):
            attention += us
        else:
            other += us
    return attention / iters / 1e3, other / iters / 1e3


def inputs(b, s, h, kv, d, layout: str, grad: bool):
    """(q, k, v) in ``bshd`` / ``sbhd`` / ``bhsd`` (views of ``bshd``), from contiguous tensors or as views of one
    packed ``[b, s, kv, (group + 2) d]`` buffer (``layout`` ending in ``-packed``), and the leaves to differentiate."""
    g = h // kv
    if layout.endswith("-packed"):
        packed = torch.randn(b, s, kv, (g + 2) * d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        q, k, v = packed[..., :g * d].reshape(b, s, h, d), packed[..., g * d:(g + 1) * d], packed[..., (g + 1) * d:]
        leaves = [packed]
    else:
        q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16) for n in (h, kv, kv))
        if layout.startswith("sbhd"):
            q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
        leaves = [t.requires_grad_(grad) for t in (q, k, v)]
    if layout.startswith("bhsd"):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return (q, k, v), leaves


def main():
    import transformer_engine.pytorch as te
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print("| shape | backend | layout | forward ms | forward TFLOP/s | fwd + bwd ms | fwd + bwd TFLOP/s | "
          "attention kernels fwd / fwd + bwd ms | other kernels fwd + bwd ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p in SHAPES.items():
        b, s, h, kv, d = p["b"], p["s"], p["heads"], p["kv"], p["d"]
        fwd_flops = 2 * 2 * b * s * s * h * d / 2
        te_dpa = {fmt: te.DotProductAttention(h, d, num_gqa_groups=kv, attention_dropout=0.0, qkv_format=fmt,
                                              attn_mask_type="causal") for fmt in ("bshd", "sbhd")}

        def torch_sdpa(backend):
            def run(q, k, v):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                            enable_gqa=h != kv)
            return run

        cases = [("TE DotProductAttention", "bshd-packed", te_dpa["bshd"]),
                 ("TE DotProductAttention", "bshd", te_dpa["bshd"]),
                 ("TE DotProductAttention", "sbhd", te_dpa["sbhd"]),
                 ("torch sdpa, cuDNN", "bhsd-packed", torch_sdpa(SDPBackend.CUDNN_ATTENTION)),
                 ("torch sdpa, cuDNN", "bhsd", torch_sdpa(SDPBackend.CUDNN_ATTENTION)),
                 ("torch sdpa, flash", "bhsd", torch_sdpa(SDPBackend.FLASH_ATTENTION))]
        for label, layout, fn in cases:
            try:
                (q, k, v), _ = inputs(b, s, h, kv, d, layout, grad=False)
                fwd = loop_ms(lambda: fn(q, k, v))
                (q, k, v), leaves = inputs(b, s, h, kv, d, layout, grad=True)
                out = fn(q, k, v)
                grad_out = torch.randn_like(out)

                def both():
                    torch.autograd.grad(fn(q, k, v), leaves, grad_out)

                total = loop_ms(both)
                (q0, k0, v0), _ = inputs(b, s, h, kv, d, layout, grad=False)
                fwd_kernels, _ = kernel_ms(lambda: fn(q0, k0, v0))
                both_kernels, glue = kernel_ms(both)
                print(f"| {name} | {label} | {layout} | {fwd:.3f} | {fwd_flops / fwd / 1e9:.0f} | {total:.3f} | "
                      f"{3.5 * fwd_flops / total / 1e9:.0f} | {fwd_kernels:.3f} / {both_kernels:.3f} | {glue:.3f} |",
                      flush=True)
            except Exception as exc:  # a backend that refuses a case says so in its row
                print(f"| {name} | {label} | {layout} | failed: {type(exc).__name__}: {str(exc)[:100]} | | | |",
                      flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
