"""The optimizer state of a Megatron ``torch_dist`` checkpoint, per parameter and whole.

The common state (``common.pt``, or megatron-core 0.19's ``common_state`` item) names the distributed optimizer's
sharding type (``optimizer.param_state_sharding_type``):

* ``dp_reshardable`` (megatron-core 0.15-0.19's default): the buffers' buckets, one group of keys per
  model-parallel rank (``dp_group_idx_<tp rank + TP x pp rank>``); the parameters are placed in them by
  :mod:`llmjp_ds.interchange.megatron_optim`'s layout, which must reproduce the stored ``per_bucket_numel_unpadded``;
* ``fully_reshardable`` (0.15+ with ``--dist-ckpt-optim-fully-reshardable``) and ``fully_sharded_model_space``
  (0.14's default), and the non-distributed optimizer: ``optimizer.state.{param|fp32_param,exp_avg,exp_avg_sq}.
  <model key>``, whole tensors of the model key's shape; 0.14 wrote the flattened slices of
  ``fully_sharded_model_space`` reformulated to ``[X/x, Y/y, ..., x*y*...]`` (a grid of local chunks, each
  flattened), put back here.

The layer split over pipeline stages and virtual chunks comes from the run's arguments (even, or with
``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``).

An MoE model's optimizer under expert parallelism is megatron-core's ChainedOptimizer: a distributed optimizer over
the dense parameters and one over the experts (buffers of their own, the expert-data-parallel group's padding); at
EP 1 the experts are ordinary data-parallel weights, in the dense buffers after each layer's router
(:func:`~llmjp_ds.interchange.megatron_moe.optimizer_counts`). Its common state holds one
entry per optimizer (``{0: ..., 1: ...}``); ``dp_reshardable`` keys each one's buckets under ``chained_<i>.``, the
experts' by their rank in the expert-tensor x expert x pipeline group (``dp_group_idx_<etp rank + ETP x ep rank +
ETP x EP x pp rank>``), each holding the rank's experts; the per-parameter formats name the model keys, whose MoE
weights stack the experts on an axis after the layers' (``mlp.experts.experts.linear_fc1.weight [L, E, 2 F, h]``;
:func:`unstack`).
"""

from __future__ import annotations

import re

import torch

from llmjp_ds.errors import fail
from llmjp_ds.interchange import megatron_adapter as ma
from llmjp_ds.interchange import megatron_moe as moe
from llmjp_ds.interchange import megatron_optim as mo

# registration order of a decoder layer's attention parameters, by layer spec (TE modules register their norm
# first; the attention registers its projection before the fused QKV, and the qk-layernorms after it), then of its
# MLP's (a dense one's; an MoE layer's norm and router, whose experts have buffers of their own):
# megatron-core 0.19's TE-spec checkpoints (tests/fixtures/megatron/te-*) and 0.16's local-spec ones place every
# master weight by it
_ATTENTION_ORDER = {
    "transformer_engine": ("self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
                           "self_attention.linear_qkv.weight"),
    "local": ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.weight",
              "self_attention.linear_qkv.weight"),
}
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
_DENSE_MLP = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_MOE_MLP = ("pre_mlp_layernorm.weight", "mlp.router.weight")
_STATE_KEYS = {"param": ("param", "fp32_param"), "exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",)}
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
_ONE_LAYER = re.compile(r"^(\d+)\.(.+)$")
_STACKED_EXPERTS = re.compile(r"^mlp\.experts\.experts\.linear_fc([12])\.weight$")


def is_optimizer_key(key: str) -> bool:
    """Whether a torch_dist key is the optimizer's (``optimizer.``, or ``chained_<i>.optimizer.`` of an MoE
    model's chained optimizers), not the model's."""
    return bool(_OPTIMIZER_KEY.match(key))


def _parts(opt) -> list[dict]:
    """The common state's optimizer entry as one part per optimizer (a ChainedOptimizer's ``{0: ..., 1: ...}``)."""
    if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt):
        return [opt[k] for k in sorted(opt)]
    return [opt]


def dist_optimizer(dcp, common: dict, args, weights: dict):
    """(name -> whole {param, exp_avg, exp_avg_sq}, optimizer step), or (None, 0) without optimizer state."""
    opt = common.get("optimizer")
    if not isinstance(opt, dict):
        return None, 0
    parts = _parts(opt)
    counts = moe.optimizer_counts(args)
    if len(parts) not in counts:
        fail(f"{dcp.dir} holds {len(parts)} optimizers where megatron-core builds {' or '.join(map(str, counts))} "
             "for its arguments (two: the dense parameters and the experts apart): it cannot be imported")
    prefixes = [f"chained_{i}." for i in range(len(parts))] if len(parts) > 1 else [""]
    if parts[0].get("param_state_sharding_type") == "dp_reshardable":
        state = _dp_reshardable(dcp, args, weights, prefixes)
        groups = [dcp.object(f"{p}optimizer.distributed.dp_group_idx_0.optimizer", {}) for p in prefixes]
    else:
        state = _per_parameter(dcp, args, weights)
        groups = [part.get("optimizer") or {} for part in parts]
    if state is None:
        return None, 0
    steps = [g.get("step") for group in groups if isinstance(group, dict) for g in group.get("param_groups", [])]
    return state, mo.optimizer_step([float(s) for s in steps if s is not None], dcp.dir)


def _per_parameter(dcp, args, weights: dict):
    num_layers = int(args.get("num_layers"))
    out: dict = {}
    for key in [k for k in dcp.tensor_keys() if not is_optimizer_key(k) and not ma.is_extra_state(k)]:
        found = {}
        for state, spellings in _STATE_KEYS.items():
            name = next((f"optimizer.state.{s}.{key}" for s in spellings if dcp.has(f"optimizer.state.{s}.{key}")),
                        None)
            if name is not None:
                found[state] = unflatten(dcp.tensor(name), dcp.shape(key), name)
        if not found:
            continue
        if len(found) < len(_STATE_KEYS):
            fail(f"{dcp.dir} holds {sorted(found)} of the optimizer state of {key} but not all of "
                 f"{sorted(_STATE_KEYS)}: the checkpoint is incomplete")
        for state, tensor in found.items():
            for name, part in unstack(key, tensor, num_layers).items():
                out.setdefault(name, {})[state] = part.float()
    if not out:
        return None
    out = ma.canonical_state(out)
    missing = sorted(set(weights) - set(out))
    if missing:
        fail(f"{dcp.dir} holds optimizer state for some weights but not for {missing[0]}: it is incomplete")
    return out


def unflatten(stored: torch.Tensor, shape: tuple, key: str) -> torch.Tensor:
    """A model-space optimizer tensor of ``shape`` from how it was stored: as is, or (megatron-core 0.14's
    flattened ``fully_sharded_model_space``) as a grid of flattened local chunks ``[X/x, ..., x*y*...]``."""
    if tuple(stored.shape) == tuple(shape):
        return stored
    grid = tuple(stored.shape[:-1])
    if len(grid) != len(shape) or any(g == 0 or s % g for s, g in zip(shape, grid)):
        fail(f"the checkpoint stores {key} with shape {list(stored.shape)}, which is neither its parameter's shape "
             f"{list(shape)} nor a grid of its chunks: it cannot be imported")
    local = [s // g for s, g in zip(shape, grid)]
    view = stored.reshape(*grid, *local)
    n = len(shape)
    order = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]  # (g0, l0, g1, l1, ...)
    return view.permute(order).reshape(shape)


def unstack(key: str, tensor: torch.Tensor, num_layers: int) -> dict:
    """A torch_dist model key as per-layer (and per-expert) names: ``decoder.layers.<rest>`` stacks the layers on
    its first axis (``decoder.layers.<i>.<rest>`` is layer i alone: megatron-core's keys where MoE and dense layers
    mix), and an MoE layer's ``mlp.experts.experts.linear_fc{1,2}.weight`` stacks its experts on the next, each
    named ``mlp.experts.linear_fc{1,2}.weight<e>`` (TE's grouped name, numbered globally)."""
    if not key.startswith("decoder.layers."):
        return {key: tensor}
    rest = key[len("decoder.layers."):]
    one = _ONE_LAYER.match(rest)
    if one:
        layers, rest = {int(one.group(1)): tensor}, one.group(2)
    elif tensor.shape[0] != num_layers:
        fail(f"the checkpoint's {key} stacks {tensor.shape[0]} layers, its arguments say num_layers={num_layers}: "
             "it is damaged or mixes runs")
    else:
        layers = {i: tensor[i] for i in range(num_layers)}
    experts = _STACKED_EXPERTS.match(rest)
    out = {}
    for i, part in layers.items():
        if experts:
            out.update({f"decoder.layers.{i}.mlp.experts.linear_fc{experts.group(1)}.weight{e}": part[e]
                        for e in range(part.shape[0])})
        else:
            out[f"decoder.layers.{i}.{rest}"] = part
    return out


def stage_layers(args) -> list[list[range]]:
    """The global decoder layers of virtual chunk ``v`` of pipeline stage ``p`` (``[v][p]``), from the run's
    arguments (Megatron places them chunk by chunk, each across the stages)."""
    layers = int(args.get("num_layers"))
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    vp = int(args.get("virtual_pipeline_model_parallel_size") or 1)
    first, last = args.get("decoder_first_pipeline_num_layers"), args.get("decoder_last_pipeline_num_layers")
    if args.get("pipeline_model_parallel_layout") or args.get("account_for_embedding_in_pipeline_split") or \
            args.get("account_for_loss_in_pipeline_split") or ((first or last) and vp > 1):
        fail("the Megatron run split its layers over pipeline stages by a custom layout: only even splits (and "
             "decoder_first/last_pipeline_num_layers without virtual pipelining) can be read from torch_dist")
    counts = [layers // (pp * vp)] * pp
    if first or last:
        middle = layers - (first or 0) - (last or 0)
        inner = pp - bool(first) - bool(last)
        counts = [middle // inner if inner else 0] * pp
        counts[0], counts[-1] = (first or counts[0]), (last or counts[-1])
    if sum(counts) * vp != layers:
        fail(f"num_layers={layers} does not split over {pp} pipeline stages x {vp} virtual chunks as the run's "
             "arguments say: the checkpoint's arguments are inconsistent")
    offsets = ma.chunk_layer_offsets([counts] * vp)
    return [[range(offsets[v][p], offsets[v][p] + counts[p]) for p in range(pp)] for v in range(vp)]


def _chunk_names(args, v: int, p: int, layers: list[list[range]], experts: bool) -> list[str]:
    """The parameters of virtual chunk ``v`` of pipeline stage ``p`` in the dense buffers, in registration order
    (canonical names); ``experts``: the experts among them (megatron-core kept them with the dense ones)."""
    spec = "local" if args.get("transformer_impl") == "local" else "transformer_engine"
    pattern = moe.layer_pattern(args)
    attention = _ATTENTION_ORDER[spec] + (_QK_NORMS if args.get("qk_layernorm") else ())
    names = ["embedding.word_embeddings.weight"] if v == 0 and p == 0 else []
    for i in layers[v][p]:
        names += [f"decoder.layers.{i}.{rest}" for rest in attention + (_MOE_MLP if pattern[i] else _DENSE_MLP)]
        if experts and pattern[i]:
            names += _expert_names(args, range(i, i + 1), 0)
    if v == len(layers) - 1 and p == len(layers[0]) - 1:
        names += ["decoder.final_layernorm.weight", "output_layer.weight"]
    return names


def _expert_names(args, chunk: range, rank: int) -> list[str]:
    """The experts' parameters of expert-parallel rank ``rank`` in the decoder layers ``chunk``, in registration
    order: TEGroupedMLP's (``--moe-grouped-gemm``) fc1 of each then fc2 of each, SequentialMLP's fc1
    and fc2 of one expert after the other."""
    ep = moe.expert_layout(args)[0]
    local = moe.num_experts(args) // ep
    pattern, first = moe.layer_pattern(args), rank * local
    grouped = [(k, e) for k in (1, 2) for e in range(local)]
    order = grouped if args.get("moe_grouped_gemm") else sorted(grouped, key=lambda ke: ke[1])
    return [f"decoder.layers.{i}.mlp.experts.linear_fc{k}.weight{first + e}" for i in chunk if pattern[i]
            for k, e in order]


def _dp_reshardable(dcp, args, weights: dict, prefixes: list[str]) -> dict:
    tp, dp = mo.arg_int(args, "tensor_model_parallel_size"), mo.arg_int(args, "data_parallel_size")
    ep, etp, edp = moe.expert_layout(args)
    layers = stage_layers(args)
    shards: dict = {}
    apart = len(prefixes) > 1
    for p in range(len(layers[0])):
        dense = [_chunk_names(args, v, p, layers, not apart) for v in range(len(layers))]
        experts = [[_expert_names(args, layers[v][p], e) if apart else [] for v in range(len(layers))]
                   for e in range(ep)]
        # a rank's parameters, which --ddp-num-buckets divides into buckets: its dense shard and its experts'
        numel = [sum(ma.tp_shard_megatron(n, weights[n], t, tp).numel() for c in dense + experts[0] for n in c)
                 for t in range(tp)]
        for t in range(tp):
            _buffers(dcp, f"{prefixes[0]}optimizer.distributed.dp_group_idx_{t + tp * p}", dense, weights, (t, tp),
                     dp, args, p, numel[t], shards)
        for e in range(ep if apart else 0):
            for t in range(etp):
                _buffers(dcp, f"{prefixes[1]}optimizer.distributed.dp_group_idx_{t + etp * e + etp * ep * p}",
                         experts[e], weights, (t, etp), edp, args, p, numel[t % tp], shards)
    return {name: {k: ma.tp_merge_megatron(name, [s[k] for s in per_t]) for k in mo.STATES}
            for name, per_t in shards.items()}


def _buffers(dcp, prefix: str, chunks: list[list[str]], weights: dict, split: tuple[int, int], dp: int, args,
             stage: int, numel: int, shards: dict) -> None:
    """Each parameter's state (``shards[name][tensor-parallel rank]``) from the buckets of one model-parallel
    rank's optimizer (``prefix``): its chunks' parameters (names in registration order), split ``split`` =
    (rank, size) over its tensor-parallel group, padded for ``dp`` data-parallel ranks."""
    t, size = split
    sizes = dcp.object(f"{prefix}.per_bucket_numel_unpadded")
    if sizes is None:
        fail(f"{dcp.dir} holds no optimizer state of {prefix}: it is incomplete")
    params = [[(n, ma.tp_shard_megatron(n, weights[n], t, size).numel(), weights[n].dtype) for n in c] for c in chunks]
    busbw = bool(args.get("ddp_pad_buckets_for_high_nccl_busbw", False))
    for index, (v, dtype, flat) in enumerate(mo.buffers_of(params)):
        buckets = mo.buffer_layout(flat, mo.bucket_size(args, v, stage, numel), dp, busbw)
        key = next((k for k in sizes[index] if k[0] == dtype), None) if index < len(sizes) else None
        if key is None or list(sizes[index][key]) != [b.numel_unpadded for b in buckets]:
            fail(f"{dcp.dir}: the optimizer buffer {index} of {prefix} holds buckets of "
                 f"{sizes[index].get(key) if key else 'unknown'} elements; the layout computed from the model and the "
                 f"run's arguments has {[b.numel_unpadded for b in buckets]}: it cannot be imported")
        stored = [{k: dcp.tensor(f"{prefix}.gbuf_idx_{index}.dtype_{key}.bucket_idx_{b}.{k}") for k in mo.STATES}
                  for b in range(len(buckets))]
        for name, tensors in mo.split_buckets(stored, buckets, str(dcp.dir)).items():
            shape = ma.tp_shard_megatron(name, weights[name], t, size).shape
            shards.setdefault(name, [None] * size)[t] = {k: x.view(shape) for k, x in tensors.items()}
