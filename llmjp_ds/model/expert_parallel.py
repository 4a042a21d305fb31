"""Expert parallelism for the model: the group an MoE layer's experts are split over, and the dispatch of each
rank's rows to the ranks that hold their experts and back (Megatron-Core's alltoall token dispatcher).

An :class:`ExpertParallel` is handed to each MoE block when it is built (``None``: every expert on every rank).
The group's ``size`` ranks hold the ``E`` experts between them, ``E / size`` each: rank ``r`` holds experts
``r E / size .. (r + 1) E / size - 1`` under the local names ``weight0 ..`` (``hf_adapter.ep_local_name``). The
group is a subgroup of the data-parallel ranks: each rank routes its own micro-batch.

:meth:`ExpertParallel.run_experts` takes the block's rows after its permutation (expert-major) and, as Megatron's
dispatcher does after its first permutation:

1. exchanges the rows' counts per expert over the group (an all-to-all of ``E`` integers);
2. sends each rank the rows of its experts (an uneven, differentiable ``all_to_all_single`` of the rows and of
   their routing weights);
3. regroups the rows it received, source rank by source rank, by local expert (Megatron's
   ``sort_chunks_by_idxs``), and runs its experts on them;
4. and the reverse: the outputs back into source-rank order, and back to the ranks the rows came from.

The all-to-all's backward is the all-to-all with the splits swapped, so each expert's gradient is the sum over
the rows of every rank of the group; DeepSpeed then sums it over the expert-data-parallel group (the ranks that
hold the same experts) and divides by the data-parallel size. The parameters of the experts carry DeepSpeed's
marks for that (``allreduce = False``, ``group_name``; :func:`mark_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertParallel:
    group: object  # the torch.distributed process group of this rank's expert-parallel group
    size: int
    rank: int
    group_name: str  # DeepSpeed's name of the group (``ep_size_<size>``), which marks the expert parameters

    def local(self, num_experts: int) -> int:
        """The experts each rank holds (validation made ``num_experts`` divisible)."""
        return num_experts // self.size

    def run_experts(self, experts, rows: torch.Tensor, tokens_per_expert: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """``experts(rows, tokens_per_local_expert, weights)`` on the rows of this rank's experts, gathered from
        every rank of the group; returns the outputs of ``rows`` (``[N, h]``, in their order), computed where
        their experts live."""
        local = self.local(tokens_per_expert.numel())
        counts = tokens_per_expert.to(torch.int64).contiguous()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, local)  # [source rank, local expert]: the rows that come here
        per_rank = received.tolist()
        send = counts.view(self.size, local).sum(1).tolist()
        recv = [sum(row) for row in per_rank]
        tokens = all_to_all(rows, send, recv, self.group)
        scales = all_to_all(weights, send, recv, self.group)
        by_rank = [n for row in per_rank for n in row]
        to_experts = [r * local + j for j in range(local) for r in range(self.size)]
        tokens, scales = sort_chunks(tokens, by_rank, to_experts), sort_chunks(scales, by_rank, to_experts)
        out = experts(tokens, received.sum(0), scales)
        by_expert = [per_rank[r][j] for j in range(local) for r in range(self.size)]
        to_ranks = [j * self.size + r for r in range(self.size) for j in range(local)]
        return all_to_all(sort_chunks(out, by_expert, to_ranks), recv, send, self.group)


def sort_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """``x`` cut into chunks of ``sizes`` rows, concatenated in ``order`` (Megatron's ``sort_chunks_by_idxs``)."""
    chunks = x.split(sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.splits = (send, recv, group)
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group = ctx.splits
        return _exchange(grad, recv, send, group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows ``x`` (``send[r]`` of them for rank ``r``, in rank order) exchanged over ``group``: the result holds
    the ``recv[r]`` rows rank ``r`` sent here, in rank order. Differentiable: backward sends the gradients back."""
    return _AllToAll.apply(x, send, recv, group)


def mark_experts(module: torch.nn.Module, ep: ExpertParallel) -> None:
    """DeepSpeed's marks of an expert parameter on each parameter of ``module``: not all-reduced over the
    data-parallel group but over the expert-data-parallel group of ``ep.group_name`` (``deepspeed.moe.utils.
    is_moe_param``)."""
    for param in module.parameters():
        param.allreduce = False
        param.group_name = ep.group_name
