"""The Triton kernel of :mod:`llmjp_ds.model.kernels.rope` (imported on first use: CUDA only).

One program takes ``BLOCK_T`` tokens and ``BLOCK_H`` heads of one segment (the query and key heads where they
lie in the packed QKV buffer, or Q, K or V alone). It loads the tokens' angles (the first half of ``freqs``,
which is ``cat(f, f)``), takes cos and sin in fp32 once per position and rotates every head of its block with
them; each half of a head is one contiguous, vectorised load. Head ``h`` of a segment lies at
``(h // GROUP) * grp + (h % GROUP) * sub`` from its token's start, so the packed buffer (``GROUP`` heads to
rotate per KV group, then the value) and a plain ``[tokens, heads, d]`` tensor are both one case. Source and
destination may be the same (in place). ``SIGN = -1`` is the inverse rotation (the backward); ``ROTATE`` False
copies.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_kernel(
    src, dst, freqs, T, S, POS_DIV, freqs_row,
    s_tok, s_grp, s_sub, d_tok, d_grp, d_sub,
    NH: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    SIGN: tl.constexpr, ROTATE: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < T
    tok = tok.to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    mask = tmask[:, None, None] & (h < NH)[None, :, None]
    head_s = (h // GROUP) * s_grp + (h % GROUP) * s_sub
    head_d = (h // GROUP) * d_grp + (h % GROUP) * d_sub
    s_off = tok[:, None, None] * s_tok + head_s[None, :, None] + i[None, None, :]
    d_off = tok[:, None, None] * d_tok + head_d[None, :, None] + i[None, None, :]
    x1 = tl.load(src + s_off, mask=mask, other=0.0)
    x2 = tl.load(src + s_off + HALF, mask=mask, other=0.0)
    if ROTATE:
        pos = (tok // POS_DIV) % S
        angle = tl.load(freqs + pos[:, None] * freqs_row + i[None, :], mask=tmask[:, None], other=0.0)
        cos = tl.cos(angle)[:, None, :]
        sin = (tl.sin(angle) * SIGN)[:, None, :]
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        tl.store(dst + d_off, (a * cos - b * sin).to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + d_off + HALF, (b * cos + a * sin).to(dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + d_off, x1, mask=mask)
        tl.store(dst + d_off + HALF, x2, mask=mask)
