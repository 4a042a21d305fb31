"""The embedding and LM head with their weight gradients accumulated straight into an fp32 ``main_grad``.

With DeepSpeed's fp32 gradient accumulation (``engine.fuse_grad_accumulation``), TE's modules add their
weight gradient into the optimizer's fp32 buffer inside the GEMM. The two ``[vocab, hidden]`` matrices are not
TE modules; autograd gives each a dense bf16 ``[V, h]`` gradient per micro-batch that is then added to the fp32
buffer: at the 172B shape that is 2 x 2.4 GB of bf16 written, read back and added into 2 x 4.9 GB of fp32, eight
times a step. Here, once the engine sets ``fuse_wgrad_accumulation`` and ``weight.main_grad`` (TE's protocol):

* the head's backward computes ``dW += dY^T X`` as one GEMM with bf16 inputs and an fp32 accumulator (on CUDA;
  a matmul and an fp32 add elsewhere);
* the embedding's backward adds only the rows of the micro-batch's tokens (``index_put_`` with
  ``accumulate``: sort-based, deterministic on CUDA) instead of materialising a dense ``[V, h]`` gradient.

Both sum in fp32 without rounding each micro-batch's gradient to bf16, set ``grad_added_to_main_grad`` and
return an uninitialised placeholder that DeepSpeed's hook drops (as TE does). Without ``main_grad`` they are
plain ``F.linear`` / ``F.embedding``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmjp_ds.model.tensor_parallel import enter_column, mark_sharded

MAIN_GRAD_WEIGHTS = ("weight",)


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


def accumulate_wgrad(main_grad: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
    """``main_grad += grad_out^T @ inp`` for 2-D ``grad_out [n, out]``, ``inp [n, in]``, summed in fp32."""
    if main_grad.is_cuda:
        torch.addmm(main_grad, grad_out.t(), inp, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(grad_out.t().to(main_grad.dtype) @ inp.to(main_grad.dtype))


class _LinearMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        accumulate_wgrad(weight.main_grad, grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1]))
        return grad_x, _placeholder(weight)


class _EmbeddingMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        ids, weight = ctx.saved_tensors
        rows = grad_out.reshape(-1, grad_out.shape[-1]).to(weight.main_grad.dtype)
        weight.main_grad.index_put_((ids.reshape(-1),), rows, accumulate=True)
        return None, _placeholder(weight)


def _fused(module) -> bool:
    return module.fuse_wgrad_accumulation and module.weight.requires_grad and torch.is_grad_enabled()


class HeadLinear(torch.nn.Linear):
    """The LM head (``nn.Linear``, no bias), initialised from ``N(0, init_std)`` (one draw, as the backends'
    ``Linear``: the initial weights do not depend on which of the two the head is)."""

    MAIN_GRAD_WEIGHTS = MAIN_GRAD_WEIGHTS
    fuse_wgrad_accumulation = False

    def __init__(self, in_features: int, out_features: int, init_std: float, device=None, dtype=None, tp=None):
        self.init_std, self.tp = init_std, tp
        super().__init__(in_features, out_features if tp is None else tp.split(out_features), bias=False,
                         device=device, dtype=dtype)
        if tp is not None:
            mark_sharded(self.weight, 0)

    def reset_parameters(self):
        torch.nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, x):
        """Under TP: column-parallel over the vocabulary (``x`` gathered from the sequence shards first)."""
        if self.tp is not None:
            x = enter_column(x, self.tp)
        return _LinearMainGrad.apply(x, self.weight) if _fused(self) else F.linear(x, self.weight)


class TokenEmbedding(torch.nn.Embedding):
    """The token embedding (``nn.Embedding``)."""

    MAIN_GRAD_WEIGHTS = MAIN_GRAD_WEIGHTS
    fuse_wgrad_accumulation = False

    def forward(self, ids):
        return _EmbeddingMainGrad.apply(ids, self.weight) if _fused(self) else super().forward(ids)
