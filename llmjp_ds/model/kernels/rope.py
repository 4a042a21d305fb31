"""RoPE on the packed QKV projection output: Q and K rotated where they lie, V untouched.

The QKV GEMM writes ``[*lead, kv groups, (group + 2) * head_dim]`` (TE's layout: each KV group's query heads,
then its key, then its value). TE's fused QKV RoPE reads all of it and writes Q, K and V again as three new
tensors, and its backward reads three gradients and writes the QKV gradient: every byte once each way.

:func:`rope_qkv` (``model.fused_qkv_rope: triton``) rotates in place instead. With one query head per KV
group (every LLM-jp-3 size but the 172B) and batch-first tokens (no tensor parallelism), Q, K and V are strided
views of the QKV buffer (TE's ``bsh3d`` attention layout, which its fused attention reads as it is), and only
the Q and K thirds are read and written; V is never touched. When TE's attention backward hands its gradients
back as views of one buffer in the same layout, the backward rotates those in place too (else it writes the
QKV gradient from the three, in one pass). With several query heads per group the heads of one group's queries
are not one view, and under tensor parallelism (sequence-first tokens) the ``sbh3d`` views have not been
measured through TE's attention: there Q, K and V are written out as TE does, by the same kernel. cos and sin
are taken in fp32 once per position and shared by every head of it (``rope_triton``), and the rotation is done
in fp32 on the bf16 inputs, as TE's kernel does.
"""

from __future__ import annotations

import importlib.util

import torch


def supported(qkv: torch.Tensor, freqs: torch.Tensor, head_dim: int) -> bool:
    """The kernel's cases: CUDA (with Triton), contiguous QKV, angles shared by every sequence, half a head a power
    of two."""
    half = head_dim // 2
    return (qkv.is_cuda and importlib.util.find_spec("triton") is not None and qkv.is_contiguous()
            and freqs.dim() == 2 and freqs.dtype == torch.float32 and freqs.stride(-1) == 1 and head_dim % 2 == 0
            and half >= 4 and half & (half - 1) == 0)


def rope_qkv(qkv: torch.Tensor, freqs: torch.Tensor, group: int, head_dim: int, qkv_format: str = "bshd"):
    """Q and K of ``qkv`` rotated by ``freqs`` (``[s, head_dim]`` fp32 angles shared by every sequence), and V, as
    ``[*lead, heads, head_dim]`` tensors, by the Triton kernel; ``qkv`` ``[*lead, kv, (group + 2) * head_dim]`` is
    rotated in place when ``group == 1`` and ``qkv_format == "bshd"`` (Q, K and V are then views of it)."""
    return _RopeQKV.apply(qkv, freqs, group, head_dim, qkv_format)


# --- segments: (tensor whose data pointer the kernel starts from, token stride, group stride, head stride) ---
# head h of a segment lies at (h // group) * group stride + (h % group) * head stride from its token's start

def _packed(qkv: torch.Tensor, group: int, d: int):
    """Q, K and V where they lie in the QKV buffer (each group's ``group`` queries, its key, its value)."""
    tok, grp = qkv.stride(1), (group + 2) * d
    return [(qkv, tok, grp, d), (qkv[..., group * d:], tok, grp, 0), (qkv[..., (group + 1) * d:], tok, grp, 0)]


def _token_stride(t: torch.Tensor) -> int | None:
    """The one stride between consecutive tokens of ``t [A, B, heads, d]``, or None if ``A x B`` is not one axis."""
    a, b = t.shape[:2]
    if t.stride(-1) != 1:
        return None
    if a == 1 or t.stride(0) == b * t.stride(1):
        return t.stride(1)
    return t.stride(0) if b == 1 else None


def _separate(t: torch.Tensor, group: int):
    """A ``[A, B, heads, d]`` tensor of its own (made plain first when its tokens are not one axis)."""
    if _token_stride(t) is None:
        t = t.contiguous()
    return t, _token_stride(t), t.stride(2) * group, t.stride(2)


def _launch(src, dst, freqs, lead, heads: int, group: int, qkv_format: str, sign: int, rotate: bool = True,
            block_t: int | None = None, block_h: int | None = None, num_warps: int = 4):
    """One segment: ``heads`` heads (``group`` per group) of each of the ``lead = (A, B)`` tokens, ``src`` to
    ``dst`` (segments as above; the same one rotates in place)."""
    from triton import cdiv

    from llmjp_ds.model.kernels.rope_triton import rope_kernel

    a, b = lead
    half = freqs.shape[-1] // 2
    seq, pos_div = (b, 1) if qkv_format == "bshd" else (a, b)
    block_h = block_h or min(1 << (heads - 1).bit_length(), max(1, 2048 // half))
    block_t = block_t or max(1, 2048 // (block_h * half))
    (s, s_tok, s_grp, s_sub), (d, d_tok, d_grp, d_sub) = src, dst
    rope_kernel[(cdiv(a * b, block_t), cdiv(heads, block_h))](
        s, d, freqs, a * b, seq, pos_div, freqs.stride(0), s_tok, s_grp, s_sub, d_tok, d_grp, d_sub,
        NH=heads, GROUP=group, HALF=half, BLOCK_T=block_t, BLOCK_H=block_h, SIGN=sign, ROTATE=rotate,
        num_warps=num_warps)


def rotate_in_place(qkv: torch.Tensor, freqs: torch.Tensor, group: int, d: int, qkv_format: str, sign: int,
                    **blocks) -> None:
    """Every query and key head of the QKV buffer rotated where it lies (one segment: each group's ``group + 1``
    heads to rotate are adjacent); the values are not touched."""
    kv = qkv.shape[2]
    seg = (qkv, qkv.stride(1), (group + 2) * d, d)
    _launch(seg, seg, freqs, qkv.shape[:2], kv * (group + 1), group + 1, qkv_format, sign, **blocks)


def rotate_between(src, dst, freqs, lead, kv: int, group: int, qkv_format: str, sign: int, **blocks) -> None:
    """Q and K rotated and V copied from the segments ``src`` to ``dst`` (``[q, k, v]`` each)."""
    _launch(src[0], dst[0], freqs, lead, kv * group, group, qkv_format, sign, **blocks)
    _launch(src[1], dst[1], freqs, lead, kv, 1, qkv_format, sign, **blocks)
    _launch(src[2], dst[2], freqs, lead, kv, 1, qkv_format, sign, rotate=False, **blocks)


def _packs(dq, dk, dv, view_stride, d: int) -> bool:
    """Whether the three gradients are the Q, K and V views of one buffer laid out as the QKV output."""
    step = d * dq.element_size()
    return (dq.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()
            and dq.stride() == dk.stride() == dv.stride() == view_stride
            and dk.data_ptr() - dq.data_ptr() == step and dv.data_ptr() - dk.data_ptr() == step)


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, freqs, group: int, head_dim: int, qkv_format: str):
        a, b, kv = qkv.shape[:3]
        d = head_dim
        ctx.group, ctx.head_dim, ctx.qkv_format = group, d, qkv_format
        ctx.qkv_shape, ctx.qkv_stride = qkv.shape, qkv.stride()
        ctx.save_for_backward(freqs)
        if group == 1 and qkv_format == "bshd":  # in place: Q and K rotated in the buffer, V untouched
            rotate_in_place(qkv, freqs, group, d, qkv_format, 1)
            q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
            ctx.view_stride = q.stride()
            return q, k, v
        ctx.view_stride = None
        out = (qkv.new_empty(a, b, kv * group, d), qkv.new_empty(a, b, kv, d), qkv.new_empty(a, b, kv, d))
        dst = [_separate(t, group if i == 0 else 1) for i, t in enumerate(out)]
        rotate_between(_packed(qkv, group, d), dst, freqs, (a, b), kv, group, qkv_format, 1)
        return out

    @staticmethod
    def backward(ctx, dq, dk, dv):
        (freqs,) = ctx.saved_tensors
        group, d = ctx.group, ctx.head_dim
        a, b, kv = ctx.qkv_shape[:3]
        if ctx.view_stride is not None and _packs(dq, dk, dv, ctx.view_stride, d):
            # the attention backward wrote one buffer in QKV's layout: rotate its Q and K back where they lie
            dqkv = torch.as_strided(dq, ctx.qkv_shape, ctx.qkv_stride)
            rotate_in_place(dqkv, freqs, group, d, ctx.qkv_format, -1)
            return dqkv, None, None, None, None
        dqkv = dq.new_empty(ctx.qkv_shape)
        src = [_separate(t, group if i == 0 else 1) for i, t in enumerate((dq, dk, dv))]
        rotate_between(src, _packed(dqkv, group, d), freqs, (a, b), kv, group, ctx.qkv_format, -1)
        return dqkv, None, None, None, None
