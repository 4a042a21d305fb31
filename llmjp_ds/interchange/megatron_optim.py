"""Where Megatron's optimizers keep each parameter's fp32 master weight and Adam moments, and how to take them out.

Megatron-Core's DistributedOptimizer lays the parameters of each model chunk out in contiguous buffers, one per
parameter dtype (``DistributedDataParallel``'s ``_ParamAndGradBuffer``; from 0.19
``DistributedOptimizer._compute_per_buffer_param_layout``, the same rule): the chunk's parameters in reverse
registration order, each starting at a multiple of 64 elements, cut into buckets of at least ``bucket_size``
elements (one bucket when ``overlap_grad_reduce`` is off, on pipeline stages after the first and on virtual
chunks after the first), each bucket padded at its end to a multiple of lcm(DP, 128) (lcm(DP, 128, 2^16) with
``ddp_pad_buckets_for_high_nccl_busbw``). Its checkpoints store the optimizer state as these buffers, without the
bucket-end padding:

* ``distrib_optim.pt`` (legacy ``torch`` format, ``save_parameter_state``): per buffer, the buckets' unpadded
  parts concatenated (``buckets_coalesced``; before that, one full tensor per bucket);
* ``torch_dist`` ``dp_reshardable`` (the default of megatron-core 0.15-0.19): one tensor per bucket,
  ``optimizer.distributed.dp_group_idx_<model-parallel rank>.gbuf_idx_<buffer>.dtype_<dtypes>.bucket_idx_<b>.
  {param,exp_avg,exp_avg_sq}``, with the bucket sizes beside them (``per_bucket_numel_unpadded``), which the
  layout computed here must reproduce.

The layout is computed from the parameters' names, shapes and dtypes (which the model part of the checkpoint
gives) and the run's arguments; a computed layout that does not add up to what the checkpoint stores is refused,
never guessed around. The other optimizer formats name each parameter (``optimizer.state.<kind>.<model key>``:
``fully_reshardable``, ``fully_sharded_model_space`` of 0.14, the non-distributed optimizer's sharded state) or
list them in parameter-group order (the non-distributed optimizer's ``torch`` state dict).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from llmjp_ds.errors import fail

STATES = ("param", "exp_avg", "exp_avg_sq")  # the fp32 master weight and Adam's moments, Megatron's keys


@dataclass
class Bucket:
    start: int  # in the buffer
    numel_unpadded: int
    params: dict = field(default_factory=dict)  # name -> (start, end) in the buffer


def pad_to(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def buffer_layout(params: list[tuple[str, int]], bucket_size: int | None, data_parallel: int,
                  high_nccl_busbw: bool = False) -> list[Bucket]:
    """The buckets of one buffer holding ``params`` ((name, numel) in registration order), as Megatron-Core's
    distributed optimizer lays them out."""
    divisor = math.lcm(data_parallel, 128, 2**16) if high_nccl_busbw else math.lcm(data_parallel, 128)
    buckets = [Bucket(0, 0)]
    index = 0
    for name, numel in reversed(params):
        bucket = buckets[-1]
        start = pad_to(index, 64)
        bucket.params[name] = (start, start + numel)
        index = start + numel
        if bucket_size is not None and index - bucket.start >= bucket_size:
            bucket.numel_unpadded = index - bucket.start
            index = pad_to(index, divisor)
            buckets.append(Bucket(index, 0))
    if not buckets[-1].params:
        buckets.pop()
    else:
        buckets[-1].numel_unpadded = index - buckets[-1].start
    return buckets


def buffers_of(chunks: list[list[tuple[str, int, torch.dtype]]]) -> list[tuple[int, torch.dtype, list]]:
    """The buffers of model chunks (each a list of (name, numel, dtype) in registration order): per chunk, one
    buffer per parameter dtype in order of first appearance. Returns (chunk, dtype, [(name, numel)]) in buffer
    order (the optimizer's ``gbuf_idx``)."""
    out = []
    for index, chunk in enumerate(chunks):
        by_dtype: dict = {}
        for name, numel, dtype in chunk:
            by_dtype.setdefault(dtype, []).append((name, numel))
        out += [(index, dtype, params) for dtype, params in by_dtype.items()]
    return out


def split_buffer(world: dict[str, torch.Tensor], buckets: list[Bucket], where: str) -> dict[str, dict]:
    """Per parameter (name -> {param, exp_avg, exp_avg_sq} flat tensors) from one buffer's state as stored with
    coalesced buckets (``world[key]``: the buckets' unpadded parts one after the other)."""
    total = sum(b.numel_unpadded for b in buckets)
    out: dict[str, dict] = {}
    offset = 0
    for bucket in buckets:
        for name, (start, end) in bucket.params.items():
            a, b = offset + start - bucket.start, offset + end - bucket.start
            out[name] = {k: world[k][a:b] for k in STATES}
        offset += bucket.numel_unpadded
    for key in STATES:
        if key not in world or world[key].numel() != total:
            fail(f"{where} holds {world[key].numel() if key in world else 'no'} {key} elements for a buffer whose "
                 f"layout (computed from the model and the run's arguments) has {total}: the checkpoint's model or "
                 "arguments do not match its optimizer state (another megatron-core layout); it cannot be imported")
    return out


def split_buckets(per_bucket: list[dict[str, torch.Tensor]], buckets: list[Bucket], where: str) -> dict[str, dict]:
    """Per parameter from one buffer's state stored one tensor per bucket (``per_bucket[b][key]``, each the
    bucket's unpadded part, or the whole bucket)."""
    if len(per_bucket) != len(buckets):
        fail(f"{where} stores {len(per_bucket)} buckets for a buffer whose layout (computed from the model and the "
             f"run's arguments: ddp_bucket_size, overlap_grad_reduce) has {len(buckets)}: it cannot be imported")
    out: dict[str, dict] = {}
    for stored, bucket in zip(per_bucket, buckets):
        for key in STATES:
            if key not in stored or stored[key].numel() < bucket.numel_unpadded:
                fail(f"{where} holds a bucket of {stored[key].numel() if key in stored else 'no'} {key} elements "
                     f"where its computed layout has {bucket.numel_unpadded}: it cannot be imported")
        for name, (start, end) in bucket.params.items():
            out[name] = {k: stored[k][start - bucket.start:end - bucket.start] for k in STATES}
    return out


def arg_int(args, name: str, default: int = 1) -> int:
    """A Megatron-LM argument as an int (``default`` where absent or None)."""
    value = args.get(name, default)
    return default if value is None else int(value)


def bucket_size(args, chunk: int, stage: int, numel: int) -> int | None:
    """Megatron-LM's DDP bucket size for model chunk ``chunk`` of pipeline stage ``stage`` (``numel``: the
    parameters of the stage): as Megatron-LM's ``get_model`` resolves it (module docstring)."""
    if chunk > 0 or stage > 0 or not args.get("overlap_grad_reduce", False) or \
            args.get("overlap_param_gather_with_optimizer_step", False):
        return None
    if args.get("ddp_num_buckets"):
        return numel // int(args.get("ddp_num_buckets"))
    return int(args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * arg_int(args, "data_parallel_size")))


def optimizer_step(steps, where: str) -> int:
    """The optimizer step of a Megatron optimizer's param groups (the same in every group that has one)."""
    found = {int(s) for s in steps if s is not None}
    if len(found) > 1:
        fail(f"{where} holds param groups at different optimizer steps {sorted(found)}: it cannot be imported")
    return found.pop() if found else 0


def group_members(names: list[tuple[str, int]], groups: list[dict], where: str) -> list[list[str]]:
    """The parameters of each group of Megatron's non-distributed optimizer: its groups split the parameters into
    those with weight decay (matrices) and those without (``wd_mult`` 0: the 1-D norm weights), each in
    registration order. ``names``: (name, ndim) in registration order."""
    out = []
    for group in groups:
        no_decay = float(group.get("wd_mult", 1.0)) == 0.0
        out.append([n for n, ndim in names if (ndim == 1) == no_decay])
    counts = [len(g.get("params", ())) for g in groups]
    if [len(m) for m in out] != counts:
        fail(f"{where} has optimizer groups of {counts} parameters; the model's weights split by weight decay give "
             f"{[len(m) for m in out]}: the optimizer groups differ from Megatron's defaults; it cannot be imported")
    return out
