"""The Triton kernel of :mod:`llmjp_ds.model.kernels.adamw` (imported on first use: CUDA only).

One program takes ``BLOCK`` elements of one flat fp32 partition: it reads the master weight, the gradient and
both moments once, and writes the weight, the moments and the bf16 copy of the weight. The three step scalars
(``coef``: the step size ``lr / (1 - beta1^t)``, ``sqrt(1 - beta2^t)`` and the clip factor) are read from device
memory, so no host synchronisation decides them. The arithmetic is torch's fused AdamW's, in the same order, with
IEEE-rounded square root and division.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def adamw_kernel(param, grad, exp_avg, exp_avg_sq, lowp, coef, n, lr, beta1, beta2, eps, weight_decay,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step_size = tl.load(coef)
    bias_correction2_sqrt = tl.load(coef + 1)
    clip = tl.load(coef + 2)
    p = tl.load(param + offs, mask=mask, other=0.0)
    g = tl.load(grad + offs, mask=mask, other=0.0) * clip
    m = tl.load(exp_avg + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(param + offs, p, mask=mask)
    tl.store(exp_avg + offs, m, mask=mask)
    tl.store(exp_avg_sq + offs, v, mask=mask)
    tl.store(lowp + offs, p.to(lowp.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
