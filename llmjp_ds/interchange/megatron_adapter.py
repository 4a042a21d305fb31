"""Megatron-LM's weight names and layouts <-> ours, as pure functions (no I/O): the map of ``import-megatron``.

Megatron-Core's ``GPTModel`` with the Transformer Engine layer spec (what Megatron-LM trains with by default):

=========================================================  =======================================================
ours (TE names, ``hf_adapter``'s)                          Megatron-Core GPTModel (TE spec)
=========================================================  =======================================================
model.embed_tokens.weight                                  embedding.word_embeddings.weight
model.layers.N.self_attention.layernorm_qkv                decoder.layers.N.self_attention.linear_qkv
  .layer_norm_weight / .weight                               .layer_norm_weight / .weight
model.layers.N.self_attention.proj.weight                  decoder.layers.N.self_attention.linear_proj.weight
model.layers.N.layernorm_mlp.layer_norm_weight             decoder.layers.N.mlp.linear_fc1.layer_norm_weight
model.layers.N.layernorm_mlp.fc1_weight                    decoder.layers.N.mlp.linear_fc1.weight
model.layers.N.layernorm_mlp.fc2_weight                    decoder.layers.N.mlp.linear_fc2.weight
model.norm.weight                                          decoder.final_layernorm.weight
lm_head.weight                                             output_layer.weight
model.layers.N.self_attention.{q,k}_norm.weight            decoder.layers.N.self_attention.{q,k}_layernorm.weight
model.layers.N.moe.norm.weight                             decoder.layers.N.pre_mlp_layernorm.weight
model.layers.N.moe.router.weight                           decoder.layers.N.mlp.router.weight
model.layers.N.moe.experts.linear_fc1.weight{e}            decoder.layers.N.mlp.experts.linear_fc1.weight{e}
model.layers.N.moe.experts.linear_fc2.weight{e}            decoder.layers.N.mlp.experts.linear_fc2.weight{e}
=========================================================  =======================================================

A mixture-of-experts layer (Megatron-Core's ``MoELayer``; a Hugging Face ``qwen3_moe`` model here) keeps its norm
apart (``pre_mlp_layernorm``; TE's MoE spec has no fused LayerNormMLP), routes with ``mlp.router.weight [E, h]``
and holds its experts as TE's grouped GEMM names them (``TEGroupedMLP``: ``linear_fc1.weight{i}`` ``[2 F, h]`` =
``[gate; up]``, ``linear_fc2.weight{i}`` ``[h, F]``); ``SequentialMLP`` (the local spec, or TE's without grouped
GEMM) names the same tensors ``mlp.experts.local_experts.{i}.linear_fc{1,2}.weight``. Megatron numbers the experts
of a file locally (``i`` of the rank's ``E / EP``): the reader numbers them globally (:func:`globalize_experts`)
before anything here sees them, so ``e`` above is the expert's global index, the index of ours. In an MoE layer the
local spec's ``pre_mlp_layernorm.weight`` (saved as ``mlp.linear_fc1.layer_norm_weight`` in ``torch_dist``) is the
MoE norm, in a dense layer the MLP's: :func:`canonical_names` tells the two apart by the layer's router and experts.

The local layer spec keeps the norms apart (``decoder.layers.N.input_layernorm.weight``,
``decoder.layers.N.pre_mlp_layernorm.weight``), and Megatron-LM's legacy model (before Megatron-Core) nests
everything under ``language_model`` (``embedding.word_embeddings``, ``encoder.layers.N.{input_norm,
self_attention.query_key_value, self_attention.dense, post_attention_norm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}``,
``encoder.final_norm``, ``output_layer``; ``*_layernorm`` in older releases): both are read too.

The layouts agree, so no tensor is rearranged: Megatron's fused QKV weight is, per query group, the group's query
heads, then its key head, then its value head (``SelfAttention.get_query_key_value_tensors`` splits it so), which is
TE's interleaved layout of ours; Megatron's ``linear_fc1`` is ``cat(gate, up)`` (SwiGLU gates the first half), as
ours. Under tensor parallelism each rank holds whole query groups of the QKV rows, ``[its gate rows; its up rows]``
of fc1, columns of ``linear_proj`` and ``linear_fc2``, and vocabulary rows of the embedding and the head (the norms
are whole on every rank): the split of ours (``hf_adapter.tp_shard``), so a Megatron shard is merged by the name
it has in ours. An expert split over the expert-tensor-parallel group is split as a dense MLP: each rank
``[its gate rows; its up rows]`` of ``linear_fc1``, columns of ``linear_fc2``; the router and the norms are whole.

Transformer Engine's ``_extra_state`` entries (FP8 scaling metadata: amax histories and scales, per Megatron
module) are dropped by :func:`from_megatron_state_dict`: Megatron's QKV, projection, fc1 and fc2 are four TE
modules, ours three (fc1 and fc2 are one ``LayerNormMLP``), so their FP8 metadata has no slot here; FP8 scaling
starts afresh. :func:`to_megatron_state_dict` writes none either (Megatron-Core builds its own). megatron-core 0.19
with TE 2.x writes one for ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` and
``decoder.final_layernorm`` (empty), and in the ``torch`` format also for ``self_attention.core_attention`` (TE's
attention) and ``output_layer`` (None): each a uint8 tensor holding a pickle that names Megatron's own recipe class
(``megatron.core.extensions.transformer_engine.TEDelayedScaling``), so the importer never unpickles it.

Under pipeline parallelism a Megatron-LM ``torch`` checkpoint numbers the decoder layers of each stage (and each
virtual-pipeline chunk, ``model0``, ``model1``, ...) from 0: :func:`chunk_layer_offsets` and
:func:`renumber_layers` put them back in place.
"""

from __future__ import annotations

import re

import torch

from llmjp_ds.errors import fail
from llmjp_ds.model.hf_adapter import tp_merge, tp_shard
from llmjp_ds.model.shapes import has_qk_norm, is_moe_layer

_OURS_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MEGATRON_LAYER = re.compile(r"^(decoder\.layers|language_model\.encoder\.layers)\.(\d+)\.(.+)$")
# ours -> Megatron-Core's (TE spec), within a layer
_LAYER_NAMES = {
    "self_attention.layernorm_qkv.layer_norm_weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.layernorm_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.proj.weight": "self_attention.linear_proj.weight",
    "layernorm_mlp.layer_norm_weight": "mlp.linear_fc1.layer_norm_weight",
    "layernorm_mlp.fc1_weight": "mlp.linear_fc1.weight",
    "layernorm_mlp.fc2_weight": "mlp.linear_fc2.weight",
    "self_attention.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attention.k_norm.weight": "self_attention.k_layernorm.weight",
    "moe.norm.weight": "pre_mlp_layernorm.weight",
    "moe.router.weight": "mlp.router.weight",
}
_SHARED_NAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_DENSE_NORM, _MOE_NORM = "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"
# Megatron's other spellings -> Megatron-Core's TE-spec names, within a dense layer (the local spec, legacy
# Megatron-LM); an MoE layer's pre-MLP norm is :data:`_MOE_NORM` under either of the first two
_LAYER_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    _MOE_NORM: _DENSE_NORM,
    "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "post_attention_norm.weight": _DENSE_NORM,
    "post_attention_layernorm.weight": _DENSE_NORM,
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
}
_SHARED_ALIASES = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.encoder.final_norm.weight": "decoder.final_layernorm.weight",
    "language_model.encoder.final_layernorm.weight": "decoder.final_layernorm.weight",
    "language_model.output_layer.weight": "output_layer.weight",
}
_TO_OURS_LAYER = {megatron: ours for ours, megatron in _LAYER_NAMES.items()}
_TO_OURS_SHARED = {megatron: ours for ours, megatron in _SHARED_NAMES.items()}
# an expert's weights within a layer: TEGroupedMLP's (the canonical form), SequentialMLP's, and ours
_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_OURS_EXPERT = re.compile(r"^moe\.experts\.linear_fc([12])\.weight(\d+)$")
_MOE_MARKS = ("mlp.router.", "mlp.experts.")  # what only an MoE layer holds


def is_extra_state(name: str) -> bool:
    return name.endswith("_extra_state")


def canonical_name(name: str, moe: bool = False) -> str | None:
    """Megatron-Core's TE-spec name of Megatron parameter ``name`` (any spec or release), in a dense layer or, with
    ``moe``, an MoE layer; None if ``name`` is not a weight of a Llama or Qwen3-MoE-style GPT model."""
    if name in _SHARED_NAMES.values():
        return name
    if name in _SHARED_ALIASES:
        return _SHARED_ALIASES[name]
    match = _MEGATRON_LAYER.match(name)
    if not match:
        return None
    rest = match.group(3)
    local = _LOCAL_EXPERT.match(rest)
    if rest in (_DENSE_NORM, _MOE_NORM):
        rest = _MOE_NORM if moe else _DENSE_NORM
    elif local:
        rest = f"mlp.experts.linear_fc{local.group(2)}.weight{local.group(1)}"
    elif rest not in _TO_OURS_LAYER and not _EXPERT.match(rest):
        rest = _LAYER_ALIASES.get(rest)
    return f"decoder.layers.{match.group(2)}.{rest}" if rest else None


def moe_layers(names) -> set[int]:
    """The decoder layers (their numbers in ``names``) that hold a router or experts."""
    return {int(m.group(2)) for m in map(_MEGATRON_LAYER.match, names) if m and m.group(3).startswith(_MOE_MARKS)}


def canonical_names(names) -> dict[str, str | None]:
    """:func:`canonical_name` of each Megatron parameter name of one model (an MoE layer known by its router and
    experts among ``names``)."""
    moe = moe_layers(names)
    return {n: canonical_name(n, bool((m := _MEGATRON_LAYER.match(n)) and int(m.group(2)) in moe)) for n in names}


def canonical_state(state: dict) -> dict:
    """``state`` (Megatron parameter name -> value) under Megatron-Core's TE-spec names; names that are no weight of
    ours are kept as they are (:func:`from_megatron_state_dict` refuses them)."""
    names = canonical_names(state)
    return {names[k] or k: v for k, v in state.items()}


def ours_name(name: str, moe: bool = False) -> str | None:
    """Our name of Megatron parameter ``name`` (any spec or release; ``moe``: of an MoE layer); None if it is not a
    weight we have."""
    name = canonical_name(name, moe)
    if name is None:
        return None
    if name in _TO_OURS_SHARED:
        return _TO_OURS_SHARED[name]
    layer, _, rest = name[len("decoder.layers."):].partition(".")
    expert = _EXPERT.match(rest)
    ours = f"moe.experts.linear_fc{expert.group(1)}.weight{expert.group(2)}" if expert else _TO_OURS_LAYER[rest]
    return f"model.layers.{layer}.{ours}"


def megatron_name(name: str) -> str:
    """Megatron-Core's TE-spec name of our parameter ``name``."""
    if name in _SHARED_NAMES:
        return _SHARED_NAMES[name]
    match = _OURS_LAYER.match(name)
    expert = _OURS_EXPERT.match(match.group(2)) if match else None
    if expert:
        return f"decoder.layers.{match.group(1)}.mlp.experts.linear_fc{expert.group(1)}.weight{expert.group(2)}"
    if not match or match.group(2) not in _LAYER_NAMES:
        fail(f"unexpected parameter {name!r} in an llmjp-ds state dict: it does not come from this model")
    return f"decoder.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def expected_shape(name: str, config) -> tuple[int, ...]:
    """The shape of our whole parameter ``name`` in a model of ``config`` (a transformers LlamaConfig, Qwen3Config
    or Qwen3MoeConfig)."""
    h, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (vocab, h)
    if name == "model.norm.weight":
        return (h,)
    rest = _OURS_LAYER.match(name).group(2)
    expert = _OURS_EXPERT.match(rest)
    if expert:
        f = config.moe_intermediate_size
        return (2 * f, h) if expert.group(1) == "1" else (h, f)
    return {"self_attention.layernorm_qkv.layer_norm_weight": (h,), "layernorm_mlp.layer_norm_weight": (h,),
            "self_attention.layernorm_qkv.weight": ((heads + 2 * kv) * d, h),
            "self_attention.proj.weight": (h, heads * d), "layernorm_mlp.fc1_weight": (2 * ffn, h),
            "layernorm_mlp.fc2_weight": (h, ffn), "self_attention.q_norm.weight": (d,),
            "self_attention.k_norm.weight": (d,), "moe.norm.weight": (h,),
            "moe.router.weight": (getattr(config, "num_experts", 0), h)}[rest]


def _check_shape(megatron: str, ours: str, tensor: torch.Tensor, config) -> None:
    want = expected_shape(ours, config)
    if tuple(tensor.shape) == want:
        return
    if ours in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[1:] == want[1:]:
        fail(f"Megatron's {megatron} has {tensor.shape[0]} vocabulary rows, the config's model has vocab_size "
             f"{want[0]}: Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP; set "
             f"model.overrides.vocab_size={tensor.shape[0]} (or the preset whose vocabulary it is)")
    fail(f"Megatron's {megatron} has shape {list(tensor.shape)}, the config's model wants {list(want)} for it: "
         "the checkpoint is of another model shape; pass the config it was trained with")


def from_megatron_state_dict(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Ours from a whole (TP-merged, globally numbered, experts included) Megatron state dict of any spec or
    release; tensors are the same objects (no copy). ``_extra_state`` entries are dropped; each weight's shape is
    checked against ``config`` (a transformers config of ours); anything that is not a weight of ours is
    refused."""
    out: dict[str, torch.Tensor] = {}
    moe, wanted = moe_layers(state), _all_names(config)
    for name, tensor in state.items():
        if is_extra_state(name):
            continue
        match = _MEGATRON_LAYER.match(name)
        ours = ours_name(name, bool(match and int(match.group(2)) in moe))
        if ours is None:
            fail(f"Megatron's checkpoint holds {name!r}, which a Llama or Qwen3-MoE-style model does not have "
                 "(biases, learned positions, shared experts, an expert bias, MLA and tied embeddings are not "
                 "supported)")
        if ours in out:
            fail(f"Megatron's checkpoint holds two tensors for {ours} ({name!r} and another spelling)")
        if ours not in wanted:
            fail(f"Megatron's checkpoint holds {name!r}, which the config's model does not have (its layers, "
                 "experts, qk-norm or dense layers differ): pass the config of the run that wrote it")
        _check_shape(name, ours, tensor, config)
        out[ours] = tensor
    missing = [megatron_name(n) for n in wanted if n not in out]
    if missing:
        fail(f"Megatron's checkpoint lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                                                             else "") + ": it is incomplete or of another model")
    return out


def to_megatron_state_dict(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Megatron-Core's TE-spec state dict from ours (inverse of :func:`from_megatron_state_dict`; tensors are
    the same objects). ``_extra_state`` entries are left out."""
    out = {}
    for name, tensor in state.items():
        if is_extra_state(name):
            continue
        _check_shape(megatron_name(name), name, tensor, config)
        out[megatron_name(name)] = tensor
    return out


def _all_names(config) -> dict[str, None]:
    """Our parameter names of a model of ``config``, in order (a dict, for its order and its lookups)."""
    dense = ("self_attention.layernorm_qkv.layer_norm_weight", "self_attention.layernorm_qkv.weight",
             "self_attention.proj.weight", "layernorm_mlp.layer_norm_weight", "layernorm_mlp.fc1_weight",
             "layernorm_mlp.fc2_weight")
    experts = getattr(config, "num_experts", 0) or 0
    names = dict.fromkeys(_SHARED_NAMES)
    for i in range(config.num_hidden_layers):
        rest = list(dense[:3]) + (["self_attention.q_norm.weight", "self_attention.k_norm.weight"]
                                  if has_qk_norm(config) else [])
        if is_moe_layer(config, i):
            rest += ["moe.norm.weight", "moe.router.weight"] + [f"moe.experts.linear_fc{k}.weight{e}"
                                                                for e in range(experts) for k in (1, 2)]
        else:
            rest += dense[3:]
        names.update(dict.fromkeys(f"model.layers.{i}.{r}" for r in rest))
    return names


# --- experts: their global numbering and their split over the expert-tensor-parallel group -------------------

def is_expert(name: str) -> bool:
    """Whether Megatron parameter ``name`` (any expert spelling) is an expert's weight (a parameter of the experts'
    optimizer, sharded over the expert-parallel group)."""
    match = _MEGATRON_LAYER.match(name)
    return bool(match and (_EXPERT.match(match.group(3)) or _LOCAL_EXPERT.match(match.group(3))))


def globalize_experts(state: dict, offset: int) -> dict:
    """A state dict of one expert-parallel rank with its experts' local numbers moved by ``offset`` (the rank
    times its experts: their global numbers), in either spelling."""
    def moved(name: str) -> str:
        m = _MEGATRON_LAYER.match(name)
        rest = m.group(3) if m else ""
        if (e := _EXPERT.match(rest)):
            return f"{m.group(1)}.{m.group(2)}.mlp.experts.linear_fc{e.group(1)}.weight{int(e.group(2)) + offset}"
        if (e := _LOCAL_EXPERT.match(rest)):
            return f"{m.group(1)}.{m.group(2)}.mlp.experts.local_experts.{int(e.group(1)) + offset}.linear_fc" \
                   f"{e.group(2)}.weight"
        return name
    return {moved(name): value for name, value in state.items()}


def _split_as(name: str) -> str | None:
    """The name of ours whose tensor-parallel split Megatron parameter ``name`` has: an expert's fc1 and fc2 are
    split as a dense MLP's (:data:`hf_adapter._TP_DIMS`), everything else as its own name's."""
    match = _MEGATRON_LAYER.match(name)
    rest = match.group(3) if match else ""
    fc = e.group(1) if (e := _EXPERT.match(rest)) else e.group(2) if (e := _LOCAL_EXPERT.match(rest)) else None
    if fc is None:
        return ours_name(name)
    return "layernorm_mlp.fc1_weight" if fc == "1" else "layernorm_mlp.fc2_weight"


# --- tensor and pipeline parallelism ---------------------------------------------------------------------------

def tp_merge_megatron(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor of Megatron parameter ``name`` from its (expert-)tensor-parallel shards (rank order)."""
    ours = _split_as(name)
    return shards[0] if ours is None else tp_merge(ours, shards)


def tp_shard_megatron(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of Megatron parameter ``name`` (whole ``tensor``), as Megatron splits it (an
    expert's over the expert-tensor-parallel group, as a dense MLP's)."""
    ours = _split_as(name)
    return tensor if ours is None else tp_shard(ours, tensor, rank, size)


def chunk_layer_offsets(layer_counts: list[list[int]]) -> list[list[int]]:
    """The global index of the first decoder layer of each model chunk, from ``layer_counts[v][p]``: the layers
    of virtual-pipeline chunk ``v`` (``model{v}``; one chunk without virtual pipelining) of pipeline stage ``p``.
    Megatron places the layers chunk by chunk, each chunk across the stages in order (even or uneven splits)."""
    offsets, start = [], 0
    for counts in layer_counts:
        row = []
        for count in counts:
            row.append(start)
            start += count
        offsets.append(row)
    return offsets


def layer_count(names) -> int:
    """How many decoder layers a chunk's state dict (local numbering) holds."""
    found = {int(m.group(2)) for m in map(_MEGATRON_LAYER.match, names) if m}
    return max(found) + 1 if found else 0


def renumber_layers(state: dict, offset: int) -> dict:
    """A chunk's state dict with its local decoder-layer numbers moved by ``offset`` (to the global ones)."""
    def moved(name: str) -> str:
        m = _MEGATRON_LAYER.match(name)
        return name if not m else f"{m.group(1)}.{int(m.group(2)) + offset}.{m.group(3)}"
    return {moved(name): value for name, value in state.items()}
