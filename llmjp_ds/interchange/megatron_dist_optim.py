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
"""

from __future__ import annotations

import torch

from llmjp_ds.interchange import megatron_optim as mo
from llmjp_ds.errors import fail
from llmjp_ds.interchange import megatron_adapter as ma

# registration order of a decoder layer's parameters, by layer spec (TE modules register their norm first; the
# attention registers its projection before the fused QKV): megatron-core 0.19's TE-spec checkpoints
# (tests/fixtures/megatron/te-*) and 0.16's local-spec ones place every master weight by it
_LAYER_ORDER = {
    "transformer_engine": ("self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
                           "self_attention.linear_qkv.weight", "mlp.linear_fc1.layer_norm_weight",
                           "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"),
    "local": ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.weight",
              "self_attention.linear_qkv.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
              "mlp.linear_fc2.weight"),
}
_STATE_KEYS = {"param": ("param", "fp32_param"), "exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",)}


def dist_optimizer(dcp, common: dict, args, weights: dict):
    """(name -> whole {param, exp_avg, exp_avg_sq}, optimizer step), or (None, 0) without optimizer state."""
    opt = common.get("optimizer")
    if not isinstance(opt, dict):
        return None, 0
    if opt.get("param_state_sharding_type") == "dp_reshardable":
        state = _dp_reshardable(dcp, args, weights)
        groups = dcp.object("optimizer.distributed.dp_group_idx_0.optimizer", {})
    else:
        state = _per_parameter(dcp, args, weights)
        groups = opt.get("optimizer") or {}
    if state is None:
        return None, 0
    steps = [g.get("step") for g in (groups.get("param_groups", []) if isinstance(groups, dict) else [])]
    return state, mo.optimizer_step([float(s) for s in steps if s is not None], dcp.dir)


def _per_parameter(dcp, args, weights: dict):
    num_layers = int(args.get("num_layers"))
    out: dict = {}
    for key in [k for k in dcp.tensor_keys() if not k.startswith("optimizer.") and not ma.is_extra_state(k)]:
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
    """A torch_dist model key (``decoder.layers.<rest>`` stacks the layers on its first axis) as per-layer
    names."""
    if not key.startswith("decoder.layers."):
        return {key: tensor}
    if tensor.shape[0] != num_layers:
        fail(f"the checkpoint's {key} stacks {tensor.shape[0]} layers, its arguments say num_layers={num_layers}: "
             "it is damaged or mixes runs")
    rest = key[len("decoder.layers."):]
    return {f"decoder.layers.{i}.{rest}": tensor[i] for i in range(num_layers)}


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


def _chunk_names(args, v: int, p: int, layers: list[list[range]]) -> list[str]:
    order = _LAYER_ORDER["local" if args.get("transformer_impl") == "local" else "transformer_engine"]
    names = ["embedding.word_embeddings.weight"] if v == 0 and p == 0 else []
    names += [f"decoder.layers.{i}.{rest}" for i in layers[v][p] for rest in order]
    if v == len(layers) - 1 and p == len(layers[0]) - 1:
        names += ["decoder.final_layernorm.weight", "output_layer.weight"]
    return names


def _dp_reshardable(dcp, args, weights: dict) -> dict:
    tp, dp = mo.arg_int(args, "tensor_model_parallel_size"), mo.arg_int(args, "data_parallel_size")
    layers = stage_layers(args)
    busbw = bool(args.get("ddp_pad_buckets_for_high_nccl_busbw", False))
    shards: dict = {}
    for p in range(len(layers[0])):
        for t in range(tp):
            prefix = f"optimizer.distributed.dp_group_idx_{t + tp * p}"
            sizes = dcp.object(f"{prefix}.per_bucket_numel_unpadded")
            if sizes is None:
                fail(f"{dcp.dir} holds no optimizer state of model-parallel rank {t + tp * p} ({prefix}): it is "
                     "incomplete")
            chunks = [[(n, ma.tp_shard_megatron(n, weights[n], t, tp).numel(), weights[n].dtype)
                       for n in _chunk_names(args, v, p, layers)] for v in range(len(layers))]
            numel = sum(n for c in chunks for _, n, _ in c)
            for index, (v, dtype, params) in enumerate(mo.buffers_of(chunks)):
                buckets = mo.buffer_layout(params, mo.bucket_size(args, v, p, numel), dp, busbw)
                key = next((k for k in sizes[index] if k[0] == dtype), None) if index < len(sizes) else None
                if key is None or list(sizes[index][key]) != [b.numel_unpadded for b in buckets]:
                    fail(f"{dcp.dir}: the optimizer buffer {index} of model-parallel rank {t + tp * p} holds buckets "
                         f"of {sizes[index].get(key) if key else 'unknown'} elements; the layout computed from the "
                         f"model and the run's arguments has {[b.numel_unpadded for b in buckets]}: it cannot be "
                         "imported")
                stored = [{k: dcp.tensor(f"{prefix}.gbuf_idx_{index}.dtype_{key}.bucket_idx_{b}.{k}")
                           for k in mo.STATES} for b in range(len(buckets))]
                for name, tensors in mo.split_buckets(stored, buckets, str(dcp.dir)).items():
                    shape = ma.tp_shard_megatron(name, weights[name], t, tp).shape
                    shards.setdefault(name, [None] * tp)[t] = {k: x.view(shape) for k, x in tensors.items()}
    return {name: {k: ma.tp_merge_megatron(name, [s[k] for s in per_t]) for k in mo.STATES}
            for name, per_t in shards.items()}
