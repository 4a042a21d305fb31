"""Cross-entropy with the z-loss over bf16 logits in two streaming Triton kernels, the gradient written over the
logits (``model.fused_loss: triton``).

The reference is :func:`llmjp_ds.model.loss.causal_lm_loss` (the eager fp32 formula). The compiled loss
(``fused_loss: true``) already keeps fp32 logits out of memory, but its backward writes a new bf16 gradient the
size of the logits (0.8 GB per 4096-token sequence at a 100k vocabulary) while the logits it was computed from
stay alive until the end of that backward. Here the forward reads each row once (an online log-sum-exp in fp32)
and keeps only one fp32 log-sum-exp per row; the backward reads the row once more and writes its gradient in
place of the logits, which nothing reads after the loss. So the backward allocates no second logits-sized
buffer, and the logits move three times (read, read, write).

The logits passed in are overwritten by the backward: the model does not return them when it computes this loss
(``LlamaForCausalLM.forward`` gives ``logits=None`` then).
"""

from __future__ import annotations

import importlib.util

import torch

BLOCK_V = 4096


def supported(logits: torch.Tensor) -> bool:
    """CUDA logits whose rows are contiguous, with Triton installed (it ships with CUDA builds of torch)."""
    return (logits.is_cuda and importlib.util.find_spec("triton") is not None
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and logits.stride(-1) == 1
            and logits.view(-1, logits.shape[-1]).stride(0) == logits.shape[-1])


def cross_entropy_z_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss_coeff: float, ignore_index: int):
    """(loss, lm_loss, z_loss) of :func:`~llmjp_ds.model.loss.causal_lm_loss` (targets equal to ``ignore_index``
    count in neither term); only ``loss`` is differentiable, and its backward overwrites ``logits`` with their
    gradient."""
    return _CrossEntropyZLoss.apply(logits, targets, float(z_loss_coeff), int(ignore_index))


class _CrossEntropyZLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, z_coeff: float, ignore_index: int):
        from llmjp_ds.model.kernels.cross_entropy_triton import cross_entropy_fwd_kernel

        vocab = logits.shape[-1]
        rows = logits.view(-1, vocab)
        flat_targets = targets.reshape(-1).contiguous()
        n = rows.shape[0]
        lse = torch.empty(n, device=logits.device, dtype=torch.float32)
        row_loss, row_z = torch.empty_like(lse), torch.empty_like(lse)
        cross_entropy_fwd_kernel[(n,)](rows, flat_targets, lse, row_loss, row_z, vocab, rows.stride(0),
                                       ignore_index, BLOCK_V=BLOCK_V, num_warps=8)
        count = (flat_targets != ignore_index).sum().clamp(min=1).float()
        lm_loss = row_loss.sum() / count
        z_loss = z_coeff * row_z.sum() / count if z_coeff else torch.zeros((), device=logits.device)
        ctx.save_for_backward(logits, flat_targets, lse, count)
        ctx.z_coeff, ctx.ignore_index = z_coeff, ignore_index
        ctx.mark_non_differentiable(lm_loss, z_loss)
        return lm_loss + z_loss, lm_loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, _grad_lm, _grad_z):
        from llmjp_ds.model.kernels.cross_entropy_triton import cross_entropy_bwd_kernel

        logits, targets, lse, count = ctx.saved_tensors
        vocab = logits.shape[-1]
        rows = logits.view(-1, vocab)
        grad = grad_loss.detach().float().reshape(1).contiguous()
        cross_entropy_bwd_kernel[(rows.shape[0],)](rows, targets, lse, grad, count, vocab, rows.stride(0),
                                                   ctx.ignore_index, ctx.z_coeff, BLOCK_V=BLOCK_V, num_warps=8)
        return logits, None, None, None
