"""``interchange/megatron_adapter``: Megatron-LM's names <-> ours, bit-exact both ways, Megatron-Core's own key names,
its tensor-parallel shards and pipeline numbering, and the refusals (a wrong vocabulary, a foreign weight)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmjp_ds.errors import UserError
from llmjp_ds.interchange import megatron_adapter as ma
from llmjp_ds.model.shapes import model_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
CONFIG = model_config("tiny", hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      ffn_hidden_size=64, vocab_size=256, seq_len=32)


def ours_state(config=CONFIG) -> dict:
    from llmjp_ds.model import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config, backend="torch")
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def test_round_trip_is_bit_exact():
    ours = ours_state()
    megatron = ma.to_megatron_state_dict(ours, CONFIG)
    back = ma.from_megatron_state_dict(megatron, CONFIG)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) and back[k].dtype == ours[k].dtype for k in ours)
    assert len(megatron) == len(ours)


def test_names_are_megatron_cores():
    """The names to_megatron_state_dict writes are the keys megatron-core 0.16 saved for the same model (its
    torch_dist fixture: the TE-spec names of every weight, the layers stacked)."""
    from llmjp_ds.checkpoint.safe_load import load_dcp_metadata

    (directory,) = (FIXTURES / "torch_dist-tp2dp2-dp_reshardable" / "save").glob("iter_*")
    saved = {k for k in load_dcp_metadata(directory / ".metadata").state_dict_metadata
             if not k.startswith(("optimizer.", "rng_state")) and "_extra_state" not in k}
    ours = {k if not k.startswith("decoder.layers.") else "decoder.layers." + k.split(".", 3)[3]
            for k in ma.to_megatron_state_dict(ours_state(), CONFIG)}
    assert ours == saved


def test_other_specs_and_legacy_names_read_as_te_names():
    ours = ours_state()
    te = ma.to_megatron_state_dict(ours, CONFIG)
    renames = {"self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", "input_norm.weight"),
               "mlp.linear_fc1.layer_norm_weight": ("pre_mlp_layernorm.weight", "post_attention_norm.weight"),
               "self_attention.linear_qkv.weight": ("self_attention.linear_qkv.weight",
                                                    "self_attention.query_key_value.weight"),
               "self_attention.linear_proj.weight": ("self_attention.linear_proj.weight",
                                                     "self_attention.dense.weight"),
               "mlp.linear_fc1.weight": ("mlp.linear_fc1.weight", "mlp.dense_h_to_4h.weight"),
               "mlp.linear_fc2.weight": ("mlp.linear_fc2.weight", "mlp.dense_4h_to_h.weight")}
    shared = {"embedding.word_embeddings.weight": "language_model.embedding.word_embeddings.weight",
              "decoder.final_layernorm.weight": "language_model.encoder.final_norm.weight",
              "output_layer.weight": "language_model.output_layer.weight"}
    local, legacy = {}, {}
    for name, tensor in te.items():
        if name in shared:
            local[name], legacy[shared[name]] = tensor, tensor
            continue
        _, _, n, rest = name.split(".", 3)
        local[f"decoder.layers.{n}.{renames[rest][0]}"] = tensor
        legacy[f"language_model.encoder.layers.{n}.{renames[rest][1]}"] = tensor
    for state in (local, legacy):
        back = ma.from_megatron_state_dict(state, CONFIG)
        assert all(back[k] is ours[k] for k in ours)


def test_extra_state_is_dropped_and_foreign_weights_refused():
    te = ma.to_megatron_state_dict(ours_state(), CONFIG)
    te["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.zeros(3, dtype=torch.uint8)
    assert len(ma.from_megatron_state_dict(te, CONFIG)) == len(te) - 1
    te["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.zeros(64)
    with pytest.raises(UserError, match="linear_qkv.bias'.*Llama or Qwen3-MoE-style model does not have"):
        ma.from_megatron_state_dict(te, CONFIG)


def test_vocabulary_mismatch_is_refused_in_one_line():
    te = ma.to_megatron_state_dict(ours_state(), CONFIG)
    te["embedding.word_embeddings.weight"] = torch.zeros(384, 32)
    with pytest.raises(UserError, match="has 384 vocabulary rows, the config's model has vocab_size 256.*"
                                        "model.overrides.vocab_size=384"):
        ma.from_megatron_state_dict(te, CONFIG)


def test_tensor_parallel_split_is_megatrons():
    """fc1 splits as [gate_r; up_r] per rank (not a plain split of cat(gate, up)), QKV by whole query groups,
    the projections by columns, the vocabulary by rows; merge inverts it."""
    te = ma.to_megatron_state_dict(ours_state(), CONFIG)
    fc1 = te["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    shard = ma.tp_shard_megatron("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    assert torch.equal(shard, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    qkv = te["decoder.layers.0.self_attention.linear_qkv.weight"]  # 2 groups of [2 q heads, k, v] x 8 rows
    assert torch.equal(ma.tp_shard_megatron("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 1, 2), qkv[32:])
    proj = te["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(ma.tp_shard_megatron("decoder.layers.0.self_attention.linear_proj.weight", proj, 0, 2),
                       proj[:, :16])
    for name, tensor in te.items():
        shards = [ma.tp_shard_megatron(name, tensor, r, 2) for r in range(2)]
        assert torch.equal(ma.tp_merge_megatron(name, shards), tensor)


def test_pipeline_numbering():
    # two virtual chunks over two stages of one layer each: chunk 0 holds layers 0 (stage 0) and 1 (stage 1)
    assert ma.chunk_layer_offsets([[1, 1], [1, 1]]) == [[0, 1], [2, 3]]
    assert ma.chunk_layer_offsets([[3, 2, 2]]) == [[0, 3, 5]]  # an uneven split
    state = {"decoder.layers.0.mlp.linear_fc2.weight": 1, "decoder.layers.1.mlp.linear_fc2.weight": 2,
             "output_layer.weight": 3}
    assert ma.layer_count(state) == 2
    assert ma.renumber_layers(state, 4) == {"decoder.layers.4.mlp.linear_fc2.weight": 1,
                                            "decoder.layers.5.mlp.linear_fc2.weight": 2, "output_layer.weight": 3}


# --- a Qwen3-MoE model: qk-layernorm, the MoE norm, the router, the experts --------------------------------------

MOE_CONFIG = model_config("tiny-moe", hidden_size=16, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=4, ffn_hidden_size=32, vocab_size=256, seq_len=32, num_experts=4,
                          experts_per_token=2, moe_ffn_hidden_size=8, dense_layers=[0])


def test_moe_round_trip_and_names():
    """Every weight of an MoE model with a dense layer 0 maps to Megatron-Core's TE-spec name and back, bit-exact:
    qk-layernorms, the MoE layer's own norm (``pre_mlp_layernorm``), the router, TEGroupedMLP's experts."""
    ours = ours_state(MOE_CONFIG)
    megatron = ma.to_megatron_state_dict(ours, MOE_CONFIG)
    back = ma.from_megatron_state_dict(megatron, MOE_CONFIG)
    assert back.keys() == ours.keys() and all(back[k] is ours[k] for k in ours)
    layer1 = {k[len("decoder.layers.1."):] for k in megatron if k.startswith("decoder.layers.1.")}
    assert layer1 == {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
                      "self_attention.linear_proj.weight", "self_attention.q_layernorm.weight",
                      "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.router.weight",
                      *(f"mlp.experts.linear_fc{k}.weight{e}" for k in (1, 2) for e in range(4))}
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in megatron  # the dense layer keeps its names


def test_moe_spellings_read_by_the_layer_they_are_in():
    """SequentialMLP's ``local_experts.{i}`` are TEGroupedMLP's ``weight{i}``; the local spec's
    ``pre_mlp_layernorm.weight`` (or torch_dist's ``mlp.linear_fc1.layer_norm_weight`` for it) is the MoE norm in
    the MoE layer and the MLP's norm in the dense one."""
    ours = ours_state(MOE_CONFIG)
    te = ma.to_megatron_state_dict(ours, MOE_CONFIG)
    local = {}
    for name, tensor in te.items():
        name = name.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
        name = name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
        for e, k in [(e, k) for e in range(4) for k in (1, 2)]:
            name = name.replace(f"experts.linear_fc{k}.weight{e}", f"experts.local_experts.{e}.linear_fc{k}.weight")
        local[name] = tensor
    assert {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight"} <= set(local)
    back = ma.from_megatron_state_dict(local, MOE_CONFIG)
    assert all(back[k] is ours[k] for k in ours)
    assert ma.canonical_state(local).keys() == te.keys()
    keyed = {k.replace("layers.1.pre_mlp_layernorm.weight", "layers.1.mlp.linear_fc1.layer_norm_weight"): v
             for k, v in te.items()}
    assert ma.canonical_state(keyed).keys() == te.keys()


def test_experts_are_numbered_globally_and_split_as_a_dense_mlp():
    """Expert-parallel rank r's local expert i is global expert r x E/EP + i, in either spelling; under expert
    tensor parallelism an expert's fc1 is [its gate rows; its up rows] per rank and its fc2 split by columns."""
    state = {"decoder.layers.1.mlp.experts.linear_fc1.weight1": 1,
             "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight": 2,
             "decoder.layers.1.mlp.router.weight": 3}
    assert ma.globalize_experts(state, 2) == {"decoder.layers.1.mlp.experts.linear_fc1.weight3": 1,
                                              "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight": 2,
                                              "decoder.layers.1.mlp.router.weight": 3}
    assert [ma.is_expert(n) for n in state] == [True, True, False]
    fc1 = torch.arange(16 * 16.0).view(16, 16)
    gate, up = fc1.chunk(2)
    for name in ("decoder.layers.1.mlp.experts.linear_fc1.weight3",
                 "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"):
        shards = [ma.tp_shard_megatron(name, fc1, r, 2) for r in range(2)]
        assert torch.equal(shards[1], torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
        assert torch.equal(ma.tp_merge_megatron(name, shards), fc1)
    fc2 = torch.arange(16 * 8.0).view(16, 8)
    assert torch.equal(ma.tp_shard_megatron("decoder.layers.1.mlp.experts.linear_fc2.weight0", fc2, 1, 2), fc2[:, 4:])
    router = torch.ones(4, 16)
    assert ma.tp_shard_megatron("decoder.layers.1.mlp.router.weight", router, 1, 2) is router


def test_an_moe_checkpoint_on_another_config_is_refused():
    """An expert the config's model does not have (more experts, or a layer the config makes dense) is one line."""
    te = ma.to_megatron_state_dict(ours_state(MOE_CONFIG), MOE_CONFIG)
    te["decoder.layers.1.mlp.experts.linear_fc1.weight4"] = torch.zeros(16, 16)
    with pytest.raises(UserError, match="holds 'decoder.layers.1.mlp.experts.linear_fc1.weight4', which the config's "
                                        "model does not have"):
        ma.from_megatron_state_dict(te, MOE_CONFIG)
    with pytest.raises(UserError, match="layers.1.pre_mlp_layernorm.weight', which the config's model does not have"):
        ma.from_megatron_state_dict(ma.to_megatron_state_dict(ours_state(MOE_CONFIG), MOE_CONFIG),
                                    model_config("tiny-moe", hidden_size=16, num_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=4, ffn_hidden_size=32,
                                                 vocab_size=256, num_experts=4, experts_per_token=2,
                                                 moe_ffn_hidden_size=8, dense_layers=[0, 1]))
