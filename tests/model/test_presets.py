"""Presets as data: shapes and parameter counts of the LLM-jp-3 and LLM-jp-4 families, built on the meta device."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from llmjp_ds.errors import UserError
from llmjp_ds.model import MODEL_SHAPES, LlamaForCausalLM, model_config, pad_vocab_size
from llmjp_ds.model.flops import flops_per_token_for, parameter_count_for
from llmjp_ds.model.shapes import check_supported, rope_theta


def count(name):
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config(name), backend="torch")
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    return total, embedding


def test_172b_matches_llmjp_published_count():
    total, embedding = count("llmjp3-172b")
    # LLM-jp: 169,947,181,056 non-embedding parameters; embedding rows padded 99487 -> 99840
    assert total - embedding == 169_947_181_056
    assert embedding == 2 * 99840 * 12288


@pytest.mark.parametrize("name, hidden, layers, heads, kv, ffn, vocab", [
    ("llmjp3-1.8b", 2048, 24, 16, 16, 7168, 99584),
    ("llmjp3-3.7b", 3072, 28, 24, 24, 8192, 99584),
    ("llmjp3-13b", 5120, 40, 40, 40, 13824, 99584),
    ("llmjp3-172b", 12288, 96, 96, 16, 38464, 99840),
])
def test_preset_shapes(name, hidden, layers, heads, kv, ffn, vocab):
    c = model_config(name)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (hidden, layers, heads, kv, ffn, vocab)
    assert c.max_position_embeddings == 4096 and c.rms_norm_eps == 1e-5
    assert c.rope_parameters["rope_theta"] == 10000.0 and not c.tie_word_embeddings


def test_1_8b_parameter_count_is_llmjp_1_8b():
    total, embedding = count("llmjp3-1.8b")
    assert 1.8e9 < total < 1.9e9 and total - embedding == 24 * (
        (3 * 2048) * 2048 + 2048 * 2048 + 3 * 2048 * 7168 + 2 * 2048) + 2048


def test_llmjp4_8b_parameter_count_is_llama3_8b_at_the_v4_vocabulary():
    per_layer = (
        4096 * 4096  # q_proj: 32 heads x 128
        + 2 * 4096 * 1024  # k, v: 8 KV groups x 128 (GQA)
        + 4096 * 4096  # o_proj
        + 3 * 4096 * 14336  # gate, up, down
        + 2 * 4096  # two RMSNorm weights
    )
    assert per_layer == 218_112_000
    non_embedding = 32 * per_layer + 4096  # + final RMSNorm
    assert non_embedding == 6_979_588_096
    assert non_embedding + 2 * 128256 * 4096 == 8_030_261_248  # Meta's Llama-3-8B, 128,256-piece vocabulary
    total, embedding = count("llmjp4-8b")
    assert embedding == 2 * 196608 * 4096 == 1_610_612_736  # tokenizer v4, embedding and head untied
    assert total - embedding == non_embedding and total == 8_590_200_832
    assert parameter_count_for(model_config("llmjp4-8b"))["total"] == total


def test_llmjp4_32b_parameter_count_from_its_sizes():
    per_layer = 2 * 5120 * 5120 + 2 * 5120 * 1024 + 3 * 5120 * 27648 + 2 * 5120  # 40 heads, 8 KV groups of 128
    assert per_layer == 487_598_080
    total, embedding = count("llmjp4-32b")
    assert total - embedding == 64 * per_layer + 5120 == 31_206_282_240
    assert embedding == 2 * 196608 * 5120 == 2_013_265_920 and total == 33_219_548_160
    assert parameter_count_for(model_config("llmjp4-32b"))["total"] == total


@pytest.mark.parametrize("name, hidden, layers, heads, ffn", [
    ("llmjp4-8b", 4096, 32, 32, 14336),
    ("llmjp4-32b", 5120, 64, 40, 27648),  # 40 heads and 8 KV groups assumed (docs/model.md)
])
def test_llmjp4_config_is_transformers_llama_config_of_its_sizes(name, hidden, layers, heads, ffn):
    """What the shape hands transformers (and the export writes as config.json) is the LlamaConfig built from
    LLMJP.md's sizes: GQA with 8 KV groups, RoPE base 500000, eps 1e-6, untied, no biases, seq 4096."""
    from transformers import LlamaConfig

    c = model_config(name)
    want = LlamaConfig(vocab_size=196608, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                       rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False,
                       mlp_bias=False, hidden_act="silu")
    assert c.to_dict() == want.to_dict()
    assert (c.num_key_value_heads, rope_theta(c), c.rms_norm_eps, c.tie_word_embeddings) == (8, 500000.0, 1e-6, False)
    check_supported(c)
    # Megatron-LM pads the vocabulary to a multiple of 128 x TP: 196,608 gains no rows at TP1-8 (the 32B ran TP4)
    assert all(pad_vocab_size(c.vocab_size, 128 * tp) == 196608 for tp in (1, 2, 4, 8))


def test_llmjp4_8b_flops_per_token_worked_by_hand():
    """Megatron-LM's count with GQA: K and V at 8 of 32 heads' width, the causal score term halved, the head at the
    whole vocabulary; the head is a tenth of the 8B's FLOPs."""
    q_proj = o_proj = 2 * 4096 * 4096
    kv_proj = 2 * (2 * 4096 * 1024)  # K and V: 8 KV groups x 128
    scores = (2 * 2 * 4096 * 4096) // 2  # QK^T and AV against 4096 keys, causal: half
    mlp = 3 * (2 * 4096 * 14336)
    layer = q_proj + kv_proj + o_proj + scores + mlp
    assert (q_proj, kv_proj, scores, mlp, layer) == (33_554_432, 16_777_216, 33_554_432, 352_321_536, 469_762_048)
    logits = 2 * 4096 * 196608
    training = 3 * (32 * layer + logits)
    assert training == 49_928_994_816
    # Megatron-LM's closed form: 12 L h^2 [(1 + g/n + s/2h) nd/h + 3/2 ffn/h] + 6 h V
    h, n, g, s = 4096, 32, 8, 4096
    closed = 12 * 32 * h * h * ((1 + Fraction(g, n) + Fraction(s, 2 * h)) * Fraction(n * 128, h)
                                + Fraction(3, 2) * Fraction(14336, h)) + 6 * h * 196608
    assert closed == training
    assert flops_per_token_for(model_config("llmjp4-8b"), 4096) == training
    assert 3 * logits / training == pytest.approx(0.0968, abs=1e-4)


def test_vocab_padding():
    assert pad_vocab_size(99487) == 99584
    assert pad_vocab_size(99487, 512) == 99840
    assert pad_vocab_size(8000) == 8064


def test_unknown_preset_and_field_are_user_errors():
    with pytest.raises(UserError, match="did you mean 'llmjp3-13b'"):
        model_config("llmjp3-13")
    with pytest.raises(UserError, match="unknown model field"):
        model_config("tiny", hidden=3)
    assert "tiny" in MODEL_SHAPES


def test_the_parity_checks_moe_is_llmjp4_32b_a3b_reduced():
    """The parity check's MoE (benchmarks/parity --moe): the 32B-A3B's qwen3_moe design (qk-norm, top-8 of
    SwiGLU experts in every layer, untied head) at 512 wide, on the LLM-jp v3 vocabulary, counted by hand."""
    c = model_config("parity-moe")
    big = model_config("llmjp4-32b-a3b")
    assert c.model_type == big.model_type == "qwen3_moe"
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.head_dim) == (32, 8, 256, 64)
    assert (c.norm_topk_prob, c.mlp_only_layers, c.tie_word_embeddings) == (big.norm_topk_prob, [], False)
    assert (c.vocab_size, rope_theta(c), c.rms_norm_eps) == (99584, 10000.0, 1e-5)  # llmjp3-1.8b's
    per_layer = (2 * 512 + 512 * (8 + 2 * 4) * 64 + 2 * 64 + 512 * 512  # norms, QKV, q/k norms, projection
                 + 32 * 512 + 32 * 3 * 256 * 512)  # router, experts
    total, embedding = count("parity-moe")
    assert embedding == 2 * 99584 * 512 and total == 8 * per_layer + 512 + embedding == 209_069_568
