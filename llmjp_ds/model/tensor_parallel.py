"""Tensor and sequence parallelism for the model: the group a layer is split over, and the four communication
operators every split layer is made of (Megatron's f, g and their sequence-parallel forms).

A :class:`TensorParallel` is handed to each layer that is split; the layers call these operators where the
communication happens, so a reader sees it. Under tensor parallelism activations are sequence-first
(``[s, b, h]``): sequence parallelism shards dimension 0, and TE all-gathers and reduce-scatters the flattened
``[s * b, h]`` along its first dimension, which is only the sequence when it comes first.

Conventions (as Megatron's): every rank of a tensor-parallel group computes the same loss. An operator whose
forward sums over the group (:func:`reduce_from`) passes the gradient through unchanged, and one whose forward is
the identity (:func:`copy_to`) sums the partial input gradients over the group in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    group: object  # the torch.distributed process group of this rank's tensor-parallel slice
    size: int
    rank: int
    sequence_parallel: bool

    def split(self, n: int) -> int:
        """This rank's share of ``n`` (heads, FFN width, vocabulary): validation made it divisible."""
        return n // self.size


def _gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def all_gather_dim0(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    x = x.contiguous()
    if _gloo(tp.group):  # gloo has no all_gather_into_tensor
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x, group=tp.group)
        return torch.cat(parts, dim=0)
    out = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=tp.group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if _gloo(tp.group):  # gloo has no reduce_scatter: the sum (into a copy), then this rank's chunk
        return _all_reduce(x, tp).chunk(tp.size, dim=0)[tp.rank].contiguous()
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=tp.group)
    return out


def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=tp.group)
    return x


def _operator(forward, backward) -> type:
    """An autograd operator over a TP group: ``forward(x, tp)`` and its adjoint ``backward(grad, tp)``."""

    class Operator(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, tp):
            ctx.tp = tp
            return forward(x, tp)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.tp), None

    return Operator


def _identity(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x


_CopyTo = _operator(_identity, _all_reduce)
_ReduceFrom = _operator(_all_reduce, _identity)
_GatherSequence = _operator(all_gather_dim0, reduce_scatter_dim0)
_ReduceScatterSequence = _operator(reduce_scatter_dim0, all_gather_dim0)


def copy_to(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Into a column-parallel GEMM without sequence parallelism: identity; backward sums the input gradients."""
    return _CopyTo.apply(x, tp)


def reduce_from(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Out of a row-parallel GEMM without sequence parallelism (and any sum of per-rank parts): all-reduce."""
    return _ReduceFrom.apply(x, tp)


def enter_column(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The full ``[s, b, h]`` input a column-parallel GEMM needs: gathered from the sequence shards (SP) or
    the replicated input itself."""
    return _GatherSequence.apply(x, tp) if tp.sequence_parallel else copy_to(x, tp)


def leave_row(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of a row-parallel GEMM's partial outputs: reduce-scattered over the sequence (SP) or all-reduced."""
    return _ReduceScatterSequence.apply(x, tp) if tp.sequence_parallel else reduce_from(x, tp)


def mark_sharded(param: torch.nn.Parameter, dim: int) -> None:
    """TE's attributes of a parameter split over the tensor-parallel group (DeepSpeed's grad norm counts such a
    parameter on every rank, a replicated one once)."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def sum_sequence_parallel_grads(module: torch.nn.Module, tp: TensorParallel | None) -> None:
    """A weight applied to this rank's sequence shard only (an RMSNorm under SP: TE, and the torch twin, mark it
    ``sequence_parallel``) gets a partial gradient; each such weight of ``module`` sums it over the group as
    autograd produces it, before DeepSpeed's own hooks accumulate or reduce it. The one place of the gradient
    work sequence parallelism adds (Megatron does it in ``finalize_model_grads``; DeepSpeed reduces gradients
    inside its engine, so it has to happen before)."""
    if tp is None or not tp.sequence_parallel:
        return
    for param in module.parameters():
        if getattr(param, "sequence_parallel", False):
            param.register_hook(lambda grad: _all_reduce(grad, tp))
