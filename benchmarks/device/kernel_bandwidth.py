"""Achieved bandwidth of the fused kernels (llmjp_ds/model/kernels) against the paths they replace, on one GPU.

    source .whl/env.sh && python benchmarks/device/kernel_bandwidth.py [--json OUT.json]

Each row: one kernel call at a bench shape's size (llmjp3-1.8b: micro-batch 2 x 4096 tokens; 172b-slice: 1 x
4096; the optimizer step: 2^30 fp32 elements), its median time over 50 calls (CUDA events) and the bytes it must
move (what it reads and writes once, as the roofline counts them) over that time. Times are device times (calls
replayed from a CUDA graph; the loss and the optimizer step: wall time over back-to-back calls). The in-place
RoPE backward is the forward kernel with the sine negated, on the gradient buffer TE's attention writes in the
QKV layout.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

SHAPES = {"llmjp3-1.8b": dict(tokens=(2, 4096), kv=16, group=1, d=128),
          "172b-slice": dict(tokens=(1, 4096), kv=16, group=6, d=128)}


def timed_ms(fn, reps: int = 20, iters: int = 10) -> float:
    """Device time of one ``fn()``: ``reps`` calls captured in a CUDA graph, replayed ``iters`` times (no launch
    overhead in the figure), the median replay over ``reps``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def bandwidth_row(shape, kernel, path, direction, ms, moved) -> dict:
    """One table row: ``moved`` bytes in ``ms`` milliseconds."""
    return {"shape": shape, "kernel": kernel, "path": path, "direction": direction, "ms": ms, "bytes": moved,
            "tb_s": moved / ms / 1e9}


def rope_rows(name, tokens, kv, group, d):
    import transformer_engine.pytorch  # noqa: F401  (loads TE's extension first)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions.fused_attn import QKVFormat

    from llmjp_ds.model.kernels import rope
    from llmjp_ds.model.llama import rope_freqs

    a, b = tokens
    qkv = torch.randn(a, b, kv, (group + 2) * d, device="cuda", dtype=torch.bfloat16)
    freqs = rope_freqs(torch.arange(b, device="cuda"), d, 10000.0)
    f = freqs[:, None, None, :].contiguous()
    split = [group * d, d, d]
    full = qkv.numel() * 2
    qk = full * (group + 1) // (group + 2)  # the bytes of Q and K
    grads = [torch.randn(a, b, n, d, device="cuda", dtype=torch.bfloat16) for n in (kv * group, kv, kv)]
    rows = []

    def row(path, direction, ms, moved):
        rows.append(bandwidth_row(name, "qkv rope", path, direction, ms, moved))

    fmt = QKVFormat["bshd"]
    row("te fused_qkv_rope", "forward",
        timed_ms(lambda: tex.fused_qkv_rope_forward(qkv, f, f, None, split, fmt, False, 1, 0)), 2 * full)
    row("te fused_qkv_rope", "backward",
        timed_ms(lambda: tex.fused_qkv_rope_backward(*grads, f, f, split, fmt, False, 1, 0)), 2 * full)
    blocks = [{}, {"num_warps": 8}, {"block_t": 2, "num_warps": 8}, {"block_t": 4, "block_h": 16, "num_warps": 8},
              {"block_h": 8}, {"block_t": 4, "num_warps": 4}]
    label = lambda kw: "triton" + (" (" + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")" if kw else "")
    if group == 1:
        for kw in blocks:
            row(label(kw) + " in place", "forward",
                timed_ms(lambda: rope.rotate_in_place(qkv, freqs, group, d, "bshd", 1, **kw)), 2 * qk)
    packed = rope._packed(qkv, group, d)
    sep = [rope._separate(g, group if i == 0 else 1) for i, g in enumerate(grads)]
    out = [rope._separate(t, group if i == 0 else 1) for i, t in enumerate(
        (qkv.new_empty(a, b, kv * group, d), qkv.new_empty(a, b, kv, d), qkv.new_empty(a, b, kv, d)))]
    for kw in blocks[:3]:
        row(label(kw) + " out of place", "forward",
            timed_ms(lambda: rope.rotate_between(packed, out, freqs, (a, b), kv, group, "bshd", 1, **kw)), 2 * full)
    for kw in blocks[:3]:
        row(label(kw) + " from three grads", "backward",
            timed_ms(lambda: rope.rotate_between(sep, packed, freqs, (a, b), kv, group, "bshd", -1, **kw)),
            2 * full)
    row("torch copy of the whole QKV buffer (a bandwidth yardstick)", "-",
        timed_ms(lambda: torch.empty_like(qkv).copy_(qkv)), 2 * full)
    return rows


def loop_ms(fn, iters: int = 10) -> float:
    """Wall time of one ``fn()`` over ``iters`` back-to-back calls (for calls of milliseconds, where launch
    overhead is noise)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def loss_rows(name, rows, vocab):
    """The loss of one micro-batch's logits, forward + backward (less the copy each call starts from): the
    compiled formula against the Triton kernels."""
    import os

    from llmjp_ds.model.loss import CausalLMLoss

    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    out = []
    moved = 3 * logits.numel() * 2  # at least: read in the forward, read and the gradient written in the backward
    for kernel in ("compiled", "triton"):
        os.environ["LLMJP_DS_FUSED_LOSS"] = kernel
        loss = CausalLMLoss(1e-4, fused=True)

        def step():
            x = logits.detach().requires_grad_(True)
            y = x.clone()  # a non-leaf, as the head's output (the Triton kernels write over it)
            loss(y, targets).loss.backward()

        base = loop_ms(lambda: logits.detach().clone())
        ms = loop_ms(step) - base
        out.append(bandwidth_row(name, "cross-entropy + z-loss", kernel, "forward + backward", ms, moved))
    os.environ.pop("LLMJP_DS_FUSED_LOSS")
    return out


def adamw_rows(elements: int = 2**30):
    """One optimizer step over a flat fp32 partition of ``elements`` (DeepSpeed's layout: one per parameter
    group), clipping: DeepSpeed's path (the clip's multiply, torch's fused AdamW, the copy into the bf16
    weights) against the one-pass kernel. Bytes as the roofline counts them: 8 + 28 + 6 per element against
    30. The per-step cost at a shape is this time scaled by its parameter count (``parameter_count_for``)."""
    from llmjp_ds.model.kernels import adamw

    param = torch.randn(elements, device="cuda")
    param.grad = torch.randn(elements, device="cuda")
    lowp = torch.empty(elements, device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW([param], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    coef = torch.tensor(0.5, device="cuda")
    state = {}
    parts = {"clip (multiply)": (lambda: param.grad.mul_(coef), 8),
             "torch fused AdamW": (opt.step, 28),
             "copy into the bf16 weights": (lambda: lowp.copy_(param), 6)}
    shape = f"{elements:,} elements"
    rows = [bandwidth_row(shape, "optimizer step", f"DeepSpeed: {path}", "-", loop_ms(fn), per * elements)
            for path, (fn, per) in parts.items()]
    rows.append(bandwidth_row(shape, "optimizer step", "DeepSpeed: all three", "-", sum(r["ms"] for r in rows),
                              42 * elements))
    ms = loop_ms(lambda: adamw.adamw_step_(param, param.grad, state, lowp, opt.param_groups[0], coef))
    rows.append(bandwidth_row(shape, "optimizer step", "one pass (triton)", "-", ms, 30 * elements))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--kernels", default="rope")
    a = p.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        if "rope" in a.kernels:
            rows += rope_rows(name, **shape)
        if "loss" in a.kernels:
            rows += loss_rows(name, shape["tokens"][0] * shape["tokens"][1], 99584 if name == "llmjp3-1.8b" else 99840)
        torch.cuda.empty_cache()
    if "adamw" in a.kernels:
        rows += adamw_rows()
    print("| shape | kernel | path | direction | ms per call | MB moved | TB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['kernel']} | {r['path']} | {r['direction']} | {r['ms']:.4f} | "
              f"{r['bytes'] / 1e6:.1f} | {r['tb_s']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
