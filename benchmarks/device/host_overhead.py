"""The host's time per call of each part of one decoder layer (TE backend), in BF16 and in FP8 delayed scaling, at
the 1.8B's widths on a short sequence: the GPU's work there is small, so back-to-back calls measure what the host
spends launching it. Each row also gives the GPU's own time for the same calls: where the host's time is the
larger, a step made of such calls keeps the GPU waiting unless its kernels are long.

    source .whl/env.sh && python benchmarks/device/host_overhead.py [--seq 128] [--calls 200]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(host microseconds per call, GPU microseconds per call) over ``calls`` back-to-back calls of ``fn``. The GPU's
    time is taken on a second pass queued behind a sleep longer than the host needs to launch it all, so that it
    runs without waiting for the host."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9 * (1.5 * host + 0.05)))  # cycles: at least that many seconds at up to 2 GHz
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return host / calls * 1e6, start.elapsed_time(end) / calls * 1e3


def main() -> None:
    import transformer_engine.pytorch as te
    from transformers import LlamaConfig

    from llmjp_ds.model.llama import DecoderLayer, rope_freqs
    from llmjp_ds.precision.recipes import Phase, te_recipe

    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=7168, num_attention_heads=16, num_key_value_heads=16,
                      num_hidden_layers=24, rms_norm_eps=1e-5, initializer_range=0.02)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0, "te", params_dtype=torch.bfloat16)
    attn = layer.self_attention
    x = torch.randn(1, a.seq, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = rope_freqs(torch.arange(a.seq, device="cuda"), 128, 10000.0)
    qkv = attn.layernorm_qkv(x).detach()
    q, k, v = (t.detach() for t in attn._L.split_qkv_rope(qkv.view(1, a.seq, 16, 3 * 128), freqs, 1, 128,
                                                         fused="triton"))
    out = attn.core_attention(q, k, v).detach()
    grad = torch.randn_like(x)
    recipe = te_recipe(Phase(index=1, precision="fp8", start_step=0, recipe="delayed", fp8_format="hybrid",
                             amax_history_len=1))

    def with_core(via_torch: bool, fn):
        """``fn`` with the layer's attention core on torch's cuDNN SDPA (``model.attention_core: cudnn``) or TE's."""
        def run():
            attn.core_attention.via_torch = via_torch
            return fn()
        return run

    parts = {
        "layernorm_qkv (LayerNormLinear)": lambda: attn.layernorm_qkv(x),
        "RoPE in place (triton)": lambda: attn._L.split_qkv_rope(qkv.clone().view(1, a.seq, 16, 3 * 128), freqs, 1,
                                                                 128, fused="triton"),
        "proj (Linear)": lambda: attn.proj(out.reshape(1, a.seq, -1)),
        "layernorm_mlp (LayerNormMLP)": lambda: layer.layernorm_mlp(x),
    }
    for core, via_torch in (("te", False), ("cudnn", True)):
        parts[f"core_attention, model.attention_core={core}"] = with_core(
            via_torch, lambda: attn.core_attention(q, k, v))
        parts[f"decoder layer forward, model.attention_core={core}"] = with_core(via_torch, lambda: layer(x, freqs))
        parts[f"decoder layer forward + backward, model.attention_core={core}"] = with_core(
            via_torch, lambda: layer(x, freqs).backward(grad))
    print("| precision | part | host us per call | GPU us per call |")
    print("|---|---|---|---|")
    for precision in ("bf16", "fp8-delayed"):
        for name, fn in parts.items():
            def call(fn=fn):
                ctx = (te.autocast(enabled=True, recipe=recipe) if precision != "bf16"
                       else contextlib.nullcontext())
                with ctx:
                    return fn()
            host, gpu = per_call_us(call, a.calls)
            print(f"| {precision} | {name} | {host:.0f} | {gpu:.0f} |", flush=True)

    def empty_autocast():
        with te.autocast(enabled=True, recipe=recipe):
            pass

    host, gpu = per_call_us(empty_autocast, a.calls)
    print(f"| fp8-delayed | te.autocast, empty | {host:.0f} | {gpu:.0f} |")


if __name__ == "__main__":
    main()
