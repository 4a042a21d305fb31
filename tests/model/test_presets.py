"""Presets as data: shapes and parameter counts of the LLM-jp-3 family, built on the meta device."""

from __future__ import annotations

import pytest
import torch

from llmjp_ds.errors import UserError
from llmjp_ds.model import MODEL_SHAPES, LlamaForCausalLM, model_config, pad_vocab_size


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
