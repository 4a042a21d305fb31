"""RoPE in place on the packed QKV output (``model.fused_qkv_rope: triton``, :mod:`llmjp_ds.model.kernels.rope`)
against its PyTorch reference and TE's fused QKV RoPE, forward and backward; and a decoder layer through it
against the same layer through TE's kernel (which checks that TE's attention reads the strided Q, K, V views and
hands back its gradients as we expect). On a CPU with Triton installed the kernel runs under Triton's
interpreter against the reference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmjp_ds.model.llama import rope_freqs
from llmjp_ds.model.torch_layers import rotate_half, split_qkv

needs_te = pytest.mark.skipif(
    not torch.cuda.is_available() or not __import__("llmjp_ds.model.backend", fromlist=["x"]).te_importable(),
    reason="needs CUDA and Transformer Engine (run on the H200)")

CASES = [(4, 1, 32), (2, 3, 16)]  # (kv groups, query heads per group, head_dim)


def reference(qkv, freqs, group, head_dim, qkv_format):
    """The formula: Q and K of ``qkv`` rotated by ``freqs`` (``[s, head_dim]`` fp32 angles shared by every sequence)
    in fp32, as TE's kernel does, and V."""
    q, k, v = split_qkv(qkv, group, head_dim)
    f = freqs[None, :, None, :] if qkv_format == "bshd" else freqs[:, None, None, :]

    def rotate(t):
        x = t.float()
        return (x * f.cos() + rotate_half(x) * f.sin()).to(t.dtype)

    return rotate(q), rotate(k), v


def _run(fn, qkv, upstream, grads_as_views: bool = False):
    """Outputs and the QKV gradient of ``fn(qkv)``; ``grads_as_views``: the upstream gradients are the Q, K, V
    views of one buffer laid out as ``qkv`` (as TE's attention backward returns them in its ``bsh3d`` layout)."""
    x = qkv.clone().requires_grad_(True)
    out = fn(x * 1)  # a non-leaf, as the QKV GEMM's output is
    if grads_as_views:
        d = upstream[0].shape[-1]
        buf = torch.cat(upstream, dim=-1)  # [.., kv, 3d]: q, k, v of one head side by side
        upstream = [buf[..., :d], buf[..., d:2 * d], buf[..., 2 * d:]]
    torch.autograd.backward(out, upstream)
    return [o.detach().clone() for o in out], x.grad


def _inputs(kv, group, d, fmt, device, a=2, b=48):
    torch.manual_seed(0)
    qkv = torch.randn(a, b, kv, (group + 2) * d, device=device, dtype=torch.bfloat16)
    seq = b if fmt == "bshd" else a
    freqs = rope_freqs(torch.arange(seq, device=device), d, 10000.0)
    upstream = [torch.randn(a, b, n, d, device=device, dtype=torch.bfloat16) for n in (kv * group, kv, kv)]
    return qkv, freqs, upstream


def _close(got, want, what):
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    print(f"[triton qkv rope] {what}: max |diff| {worst:.2e}")
    for a, b in zip(got, want):  # both rotate in fp32: a bf16 rounding apart at most
        assert a.shape == b.shape and a.stride()[-1] == 1
        torch.testing.assert_close(a, b, atol=1e-2, rtol=8e-3)


def interpreted(check: str, module: str = __name__) -> None:
    """Run ``check`` (a function of ``module``) in a fresh interpreter under ``TRITON_INTERPRET=1``: Triton
    reads the switch once per process, and another test may have imported it first."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"import {module} as m; m.{check}()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def check_rope_under_the_interpreter():
    from llmjp_ds.model.kernels import rope

    for fmt in ("bshd", "sbhd"):
        for kv, group, d in CASES:
            qkv, freqs, upstream = _inputs(kv, group, d, fmt, "cpu", b=8)
            want = _run(lambda t: reference(t, freqs, group, d, fmt), qkv, upstream)
            for views in (False, True) if group == 1 else (False,):
                out, grad = _run(lambda t: rope.rope_qkv(t, freqs, group, d, fmt), qkv, upstream, views)
                _close(out + [grad], want[0] + [want[1]], f"interpreter {fmt} kv={kv} group={group} views={views}")


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="the interpreter check is for CPU machines with Triton installed")
def test_kernel_matches_the_reference_under_the_interpreter():
    interpreted("check_rope_under_the_interpreter")


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("kv,group,d", [(16, 1, 128), (4, 6, 128), *CASES])
def test_kernel_matches_te_and_the_reference(fmt, kv, group, d):
    """Q, K, V and the QKV gradient of the Triton kernel equal TE's fused QKV RoPE's and the fp32 formula's, with
    the upstream gradients as separate tensors and as views of one buffer (the in-place backward)."""
    from llmjp_ds.model import te_layers

    qkv, freqs, upstream = _inputs(kv, group, d, fmt, "cuda")
    te_out, te_grad = _run(lambda t: te_layers.split_qkv_rope(t, freqs, group, d, fmt, fused="te"), qkv, upstream)
    ref_out, ref_grad = _run(lambda t: reference(t, freqs, group, d, fmt), qkv, upstream)
    for views in (False, True) if group == 1 else (False,):
        out, grad = _run(lambda t: te_layers.split_qkv_rope(t, freqs, group, d, fmt, fused="triton"), qkv,
                         upstream, views)
        _close(out + [grad], te_out + [te_grad], f"vs TE {fmt} kv={kv} group={group} views={views}")
        _close(out + [grad], ref_out + [ref_grad], f"vs formula {fmt} kv={kv} group={group} views={views}")


@pytest.mark.gpu
@needs_te
def test_the_model_path_takes_the_kernel():
    """``split_qkv_rope(fused="triton")``, as the decoder layer calls it, rotates in place (one query head per
    group) rather than falling back to TE's kernel."""
    from llmjp_ds.model import te_layers
    from llmjp_ds.model.kernels import rope

    qkv, freqs, _ = _inputs(16, 1, 128, "bshd", "cuda")
    conditions = {"cuda": qkv.is_cuda, "contiguous": qkv.is_contiguous(), "freqs 2-d": freqs.dim() == 2,
                  "freqs fp32": freqs.dtype == torch.float32, "freqs stride": freqs.stride(-1) == 1}
    q, _, _ = te_layers.split_qkv_rope(qkv, freqs, 1, 128, "bshd", fused="triton")
    assert rope.supported(qkv, freqs, 128), conditions
    assert q.data_ptr() == qkv.data_ptr(), conditions


@pytest.mark.gpu
@needs_te
def test_in_place_rotation_leaves_v_and_returns_views():
    from llmjp_ds.model.kernels import rope

    qkv, freqs, _ = _inputs(16, 1, 128, "bshd", "cuda")
    before = qkv.clone()
    q, k, v = rope.rope_qkv(qkv, freqs, 1, 128)
    assert q.data_ptr() == qkv.data_ptr() and v.data_ptr() == qkv.data_ptr() + 2 * 128 * qkv.element_size()
    torch.testing.assert_close(v, before[..., 256:], atol=0, rtol=0)
    assert not torch.equal(q, before[..., :128])


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("heads,kv", [(8, 8), (8, 2)])
def test_decoder_layer_through_triton_rope_matches_te_rope(heads, kv):
    """A TE decoder layer with ``fused_qkv_rope = "triton"`` gives the output, the input gradient and the
    weight gradients of the same layer with TE's kernel: TE's attention reads the strided Q, K, V views."""
    from llmjp_ds.model import model_config
    from llmjp_ds.model.llama import DecoderLayer, head_dim_of
    from llmjp_ds.model.options import ModelOptions

    config = model_config("tiny", hidden_size=1024, num_layers=1, num_attention_heads=heads,
                          num_key_value_heads=kv, ffn_hidden_size=2048, vocab_size=256, seq_len=512)
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(x)
    freqs = rope_freqs(torch.arange(512, device="cuda"), head_dim_of(config), 10000.0)
    results = []
    for mode in ("te", "triton"):
        torch.manual_seed(0)  # the same weights for both
        layer = DecoderLayer(config, 0, "te", params_dtype=torch.bfloat16, options=ModelOptions(fused_qkv_rope=mode))
        xi = x.clone().requires_grad_(True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = layer(xi, freqs)
            out.backward(up)
            torch.cuda.synchronize()
        kernels = {e.key for e in prof.key_averages()}
        ours, te_rope = any("rope_kernel" in k for k in kernels), any("fused_qkv_rope" in k for k in kernels)
        assert (ours, te_rope) == ((True, False) if mode == "triton" else (False, True)), sorted(kernels)
        results.append([out.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    for got, want in zip(*results):  # attention and the GEMMs sum thousands of bf16 products: relative norms
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"[triton qkv rope] decoder layer heads={heads} kv={kv} {tuple(want.shape)}: relative diff {rel:.1e}")
        assert rel < 1e-2
