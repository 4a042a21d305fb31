"""The Triton kernels of :mod:`llmjp_ds.model.kernels.cross_entropy` (imported on first use: CUDA only).

One program per row of the bf16 logits. The forward streams the row once in ``BLOCK_V`` blocks, keeping a
running maximum and sum of exponentials in fp32 (the online log-sum-exp), and writes the row's log-sum-exp,
its cross-entropy ``lse - x[target]`` and ``lse^2`` (zero where the target is ignored). The backward streams the
row once more and writes the gradient over the logits where they lie:
``scale * (softmax * (1 + 2 * z_coeff * lse) - onehot(target))`` with ``scale = grad_output / count`` read from
device memory (no host synchronisation).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cross_entropy_fwd_kernel(logits, targets, lse_out, loss_out, z_out, V, row_stride, ignore_index,
                             BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        s = s * tl.exp(m - new_m) + tl.exp(x - new_m)
        m = new_m
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)
    lse = row_max + tl.log(total)
    target = tl.load(targets + row)
    keep = target != ignore_index
    x_t = tl.load(base + tl.where(keep, target, 0)).to(tl.float32)
    tl.store(lse_out + row, lse)
    tl.store(loss_out + row, tl.where(keep, lse - x_t, 0.0))
    tl.store(z_out + row, tl.where(keep, lse * lse, 0.0))


@triton.jit
def cross_entropy_bwd_kernel(logits, targets, lse_in, grad_out, count, V, row_stride, ignore_index, z_coeff,
                             BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(targets + row)
    keep = target != ignore_index
    lse = tl.load(lse_in + row)
    scale = tl.where(keep, tl.load(grad_out).to(tl.float32) / tl.maximum(tl.load(count).to(tl.float32), 1.0), 0.0)
    p_scale = scale * (1.0 + 2.0 * z_coeff * lse)
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        mask = idx < V
        x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * p_scale - tl.where(idx == target, scale, 0.0)
        tl.store(base + idx, g.to(logits.dtype.element_ty), mask=mask)
