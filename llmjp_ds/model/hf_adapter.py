"""Every weight-name map of the package, as pure functions: Hugging Face Llama <-> ours (TE names) <-> the
pipeline's layer index, and each rank's share of a weight under tensor or expert parallelism.

No I/O here: dict of tensors in, dict of tensors out, bit-exact (only views, splits and concatenations).

=========================================================  ==============================================
ours (TE names)                                            Hugging Face LlamaForCausalLM
=========================================================  ==============================================
layers.N.self_attention.layernorm_qkv.layer_norm_weight    layers.N.input_layernorm.weight
layers.N.self_attention.layernorm_qkv.weight               layers.N.self_attn.{q,k,v}_proj.weight
                                                           (interleaved per KV group: [q heads, k, v])
layers.N.self_attention.proj.weight                        layers.N.self_attn.o_proj.weight
layers.N.layernorm_mlp.layer_norm_weight                   layers.N.post_attention_layernorm.weight
layers.N.layernorm_mlp.fc1_weight                          layers.N.mlp.{gate,up}_proj.weight  (cat, gate first)
layers.N.layernorm_mlp.fc2_weight                          layers.N.mlp.down_proj.weight
layers.N.self_attention.{q,k}_norm.weight                  layers.N.self_attn.{q,k}_norm.weight   (qwen3*)
layers.N.moe.norm.weight                                   layers.N.post_attention_layernorm.weight  (MoE)
layers.N.moe.router.weight                                 layers.N.mlp.gate.weight
layers.N.moe.experts.linear_fc1.weight{e}                  layers.N.mlp.experts.{e}.{gate,up}_proj.weight
layers.N.moe.experts.linear_fc2.weight{e}                  layers.N.mlp.experts.{e}.down_proj.weight
=========================================================  ==============================================

An MoE model (Hugging Face ``qwen3_moe``) is written with per-expert keys, as transformers' ``save_pretrained``
writes them; read in that form or in transformers' fused one (``mlp.experts.gate_up_proj [E, 2 F, h]``,
``mlp.experts.down_proj [E, h, F]``).

``model.embed_tokens.weight``, ``model.norm.weight`` and ``lm_head.weight`` keep their names. TE's
``_extra_state`` entries (FP8 scaling metadata) have no HF counterpart and are dropped on export.

The pipeline (``model/pipeline_layers.py``) holds the same modules as layers ``0`` (embedding), ``1..N`` (decoder
layers) and ``N + 1`` (final norm and head); :func:`pipeline_name_to_ours` maps a layer's parameter name to
ours, which is also how DeepSpeed's ``layer_XX-model_states.pt`` files are read.
"""

from __future__ import annotations

import re

import torch

from llmjp_ds.errors import fail
from llmjp_ds.model.shapes import is_moe_layer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SHARED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_RENAMES = {  # ours -> HF, within a layer
    "self_attention.layernorm_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.proj.weight": "self_attn.o_proj.weight",
    "layernorm_mlp.layer_norm_weight": "post_attention_layernorm.weight",
    "layernorm_mlp.fc2_weight": "mlp.down_proj.weight",
    "self_attention.q_norm.weight": "self_attn.q_norm.weight",
    "self_attention.k_norm.weight": "self_attn.k_norm.weight",
    "moe.norm.weight": "post_attention_layernorm.weight",
    "moe.router.weight": "mlp.gate.weight",
}
_MOE_ONLY = ("moe.norm.weight", "moe.router.weight")  # the MoE layer's names for what a dense layer calls otherwise
_EXPERT = re.compile(r"^moe\.experts\.linear_fc([12])\.weight(\d+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED = {"mlp.experts.gate_up_proj": 1, "mlp.experts.down_proj": 2}
_QKV = "self_attention.layernorm_qkv.weight"
_FC1 = "layernorm_mlp.fc1_weight"
_HF_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_HF_FC1 = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_HF_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _dims(config):
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    return heads, kv, getattr(config, "head_dim", None) or config.hidden_size // heads


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config) -> torch.Tensor:
    """HF q/k/v projections -> TE's fused QKV weight, interleaved per KV group."""
    heads, kv, d = _dims(config)
    h = q.shape[1]
    q = q.view(kv, heads // kv, d, h)
    return torch.cat((q, k.view(kv, 1, d, h), v.view(kv, 1, d, h)), dim=1).reshape(-1, h)


def split_qkv(qkv: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv, d = _dims(config)
    h = qkv.shape[1]
    q, k, v = qkv.view(kv, heads // kv + 2, d, h).split([heads // kv, 1, 1], dim=1)
    return q.reshape(heads * d, h), k.reshape(kv * d, h), v.reshape(kv * d, h)


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith("_extra_state"):
            continue
        if name in _SHARED:
            out[name] = tensor
            continue
        match = _LAYER.match(name)
        if not match:
            fail(f"unexpected parameter {name!r} in an llmjp-ds state dict: it does not come from this model")
        prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
        expert = _EXPERT.match(rest)
        if rest in _RENAMES:
            out[prefix + _RENAMES[rest]] = tensor
        elif expert:
            e = f"{prefix}mlp.experts.{expert.group(2)}."
            if expert.group(1) == "1":
                out[e + "gate_proj.weight"], out[e + "up_proj.weight"] = tensor.chunk(2, dim=0)
            else:
                out[e + "down_proj.weight"] = tensor
        elif rest == _QKV:
            for hf_name, part in zip(_HF_QKV, split_qkv(tensor, config)):
                out[prefix + hf_name] = part
        elif rest == _FC1:
            for hf_name, part in zip(_HF_FC1, tensor.chunk(2, dim=0)):
                out[prefix + hf_name] = part
        else:
            fail(f"unexpected parameter {name!r} in an llmjp-ds state dict: it does not come from this model")
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    dense = {hf: ours for ours, hf in _RENAMES.items() if ours not in _MOE_ONLY}
    moe = {**dense, **{hf: ours for ours, hf in _RENAMES.items() if ours in _MOE_ONLY}}
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        if _HF_IGNORED.search(name):
            continue
        if name in _SHARED:
            out[name] = tensor
            continue
        match = _LAYER.match(name)
        rest = match.group(2) if match else None
        inverse = (moe if is_moe_layer(config, int(match.group(1))) else dense) if match else {}
        if rest in inverse:
            out[f"model.layers.{match.group(1)}.{inverse[rest]}"] = tensor
        elif rest in _HF_QKV or rest in _HF_FC1 or (rest and _HF_EXPERT.match(rest)):
            pending.setdefault(f"model.layers.{match.group(1)}.", {})[rest] = tensor
        elif rest in _HF_FUSED:
            for e, part in enumerate(tensor.unbind(0)):  # transformers' in-memory layout: [E, out, in]
                out[f"model.layers.{match.group(1)}.moe.experts.linear_fc{_HF_FUSED[rest]}.weight{e}"] = part
        else:
            fail(f"checkpoint tensor {name!r} is not part of a Llama or Qwen3(-MoE) model (biases, other "
                 "architectures and quantised weights are not supported)")
    for prefix, parts in pending.items():
        _experts_from_hf(prefix, parts, out)
        layer = int(prefix.split(".")[2])
        needed = _HF_QKV + (() if is_moe_layer(config, layer) else _HF_FC1)
        missing = [n for n in needed if n not in parts]
        if missing:
            fail(f"checkpoint lacks {prefix}{missing[0]}: the file is incomplete or not a model of its config.json")
        out[prefix + _QKV] = fuse_qkv(*(parts[n] for n in _HF_QKV), config)
        if not is_moe_layer(config, layer):
            out[prefix + _FC1] = torch.cat([parts[n] for n in _HF_FC1], dim=0)
    return out


def _experts_from_hf(prefix: str, parts: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    """One layer's per-expert HF weights (``mlp.experts.{e}.{gate,up,down}_proj.weight``) as ours, in ``out``."""
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for rest, tensor in parts.items():
        match = _HF_EXPERT.match(rest)
        if match:
            experts.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    for e, proj in sorted(experts.items()):
        if len(proj) != 3:
            missing = sorted({"gate_proj", "up_proj", "down_proj"} - set(proj))[0]
            fail(f"checkpoint lacks {prefix}mlp.experts.{e}.{missing}.weight: the file is incomplete")
        out[f"{prefix}moe.experts.linear_fc1.weight{e}"] = torch.cat([proj["gate_proj"], proj["up_proj"]], dim=0)
        out[f"{prefix}moe.experts.linear_fc2.weight{e}"] = proj["down_proj"]


# --- the pipeline's layers ----------------------------------------------------------------------------------

EMBEDDING_LAYER = 0


def pipeline_name_to_ours(layer_index: int, num_layers: int, name: str) -> str:
    """Our name of parameter ``name`` of pipeline layer ``layer_index`` (of a model with ``num_layers``)."""
    if layer_index == EMBEDDING_LAYER:
        return f"model.embed_tokens.{name}"
    if layer_index <= num_layers:
        return f"model.layers.{layer_index - 1}.{name}"
    if name.startswith("norm."):
        return "model." + name
    return name  # lm_head.weight


def pipeline_module_name_to_ours(name: str, num_layers: int) -> str:
    """Our name of a pipeline module's parameter ``name`` (``<layer index>.<the layer's name>``)."""
    index, _, rest = name.partition(".")
    return pipeline_name_to_ours(int(index), num_layers, rest)


# --- tensor-parallel shards ---------------------------------------------------------------------------------
# how each of our weights is split over a tensor-parallel group (TE's layout): rows of the column-parallel GEMMs
# (QKV: whole KV groups, as the interleaved layout keeps each group's rows together), columns of the
# row-parallel ones, vocabulary rows of the embedding and the head; the RMSNorm weights are replicated
_TP_DIMS = (("self_attention.layernorm_qkv.weight", 0), ("self_attention.proj.weight", 1),
            ("layernorm_mlp.fc1_weight", 0), ("layernorm_mlp.fc2_weight", 1), ("embed_tokens.weight", 0),
            ("lm_head.weight", 0))
_GATED = "layernorm_mlp.fc1_weight"  # each rank's fc1 is [its gate rows; its up rows]


def tp_split_dim(name: str) -> int | None:
    """The dimension ``name`` (ours, or a pipeline layer's) is split along under TP; None: replicated."""
    for suffix, dim in _TP_DIMS:
        if name.endswith(suffix):
            return dim
    return None


def tp_shard(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of the whole ``tensor`` named ``name``, of a group of ``size``."""
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return tensor
    if name.endswith(_GATED):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return tensor.chunk(size, dim=dim)[rank]


def tp_merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from every rank's part (in rank order); inverse of :func:`tp_shard`. A replicated
    tensor is taken from rank 0."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith(_GATED):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def tp_merge_state_dicts(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One state dict from the TP ranks' ones (rank order). ``_extra_state`` entries are rank 0's."""
    return {name: tp_merge(name, [s[name] for s in shards]) for name in shards[0]}


# --- expert-parallel shards ---------------------------------------------------------------------------------
# an MoE layer's experts are whole on their rank: rank r of an expert-parallel group of experts E / size each
# holds experts r E / size .. under the local indices 0 ..; every other weight is on every rank
_EXPERT_WEIGHT = re.compile(r"^((?:.*\.)?experts\.linear_fc[12]\.weight)(\d+)$")


def is_expert_weight(name: str) -> bool:
    """Whether ``name`` (ours or a pipeline layer's) is an expert's weight of an MoE layer."""
    return _EXPERT_WEIGHT.match(name) is not None


def ep_local_name(name: str, rank: int, local: int) -> str | None:
    """Rank ``rank``'s name of the weight ``name`` (ours, the expert's global index) when each rank holds
    ``local`` experts: the local index of an expert it holds, None for another rank's expert, ``name`` itself
    for every other weight."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return name
    index = int(match.group(2)) - rank * local
    return f"{match.group(1)}{index}" if 0 <= index < local else None


def ep_global_name(name: str, rank: int, local: int) -> str:
    """Our name of rank ``rank``'s weight ``name`` (an expert's local index) when each rank holds ``local``
    experts; inverse of :func:`ep_local_name`."""
    match = _EXPERT_WEIGHT.match(name)
    return name if match is None else f"{match.group(1)}{rank * local + int(match.group(2))}"
