"""``llmjp-ds import-hf`` of a Hugging Face ``qwen3_moe`` directory (continuing llm-jp-4-32b-a3b-base): the run keeps
the preset's model shape, which must be the model's field for field (experts, top-k, expert width, dense layers,
the dense dimensions, RoPE base and epsilon); a mismatch is one line naming both values and the preset whose shape
it is, and nothing is written. The sequence length is the run's, not the model's context."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from llmjp_ds.config import RunConfig, load_config, model_config_of
from llmjp_ds.config.schema import ModelConfig
from llmjp_ds.errors import UserError
from llmjp_ds.interchange.hf import import_hf
from llmjp_ds.model.shapes import model_config

SHAPE = dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             ffn_hidden_size=48, vocab_size=256, num_experts=4, experts_per_token=2, moe_ffn_hidden_size=16)


@pytest.fixture
def moe_preset(monkeypatch):
    """A run preset of the test's MoE shape (tiny-moe with overrides), as llmjp4-32b-a3b is llm-jp-4-32b-a3b's."""
    from llmjp_ds.config.presets import RUN_PRESETS

    def preset():
        return RunConfig(run_dir="runs/moe", model=ModelConfig(shape="tiny-moe", overrides=dict(SHAPE)))

    monkeypatch.setitem(RUN_PRESETS, "test-moe", preset)
    return "test-moe"


def hf_moe(path, **changes):
    """A qwen3_moe directory written by transformers itself (its context longer than any run's sequences)."""
    from transformers import Qwen3MoeForCausalLM

    config = model_config("tiny-moe", **{**SHAPE, **changes})
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def test_a_qwen3_moe_model_of_the_presets_shape_starts_a_run(tmp_path, moe_preset):
    hf = hf_moe(tmp_path / "hf")
    path = import_hf(hf, tmp_path / "run", preset=moe_preset)
    data = yaml.safe_load(path.read_text())
    assert data["model"]["shape"] == "tiny-moe" and data["model"]["init_from_hf"] == str(hf.resolve())
    config = model_config_of(load_config(path))
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        "qwen3_moe", 4, 2, 16)


MISMATCHES = [({"num_experts": 8},
               r"num_experts=8, but the preset test-moe's model \(shape tiny-moe\) has num_experts=4"),
              ({"experts_per_token": 1}, "experts_per_token=1, but .* has experts_per_token=2"),
              ({"moe_ffn_hidden_size": 24}, "moe_ffn_hidden_size=24, but .* has moe_ffn_hidden_size=16"),
              ({"dense_layers": [0]}, r"dense_layers=\[0\], but .* has dense_layers=\[\]"),
              ({"num_layers": 3}, "num_layers=3, but .* has num_layers=2"),
              ({"rope_theta": 500000.0}, "rope_theta=500000.0, but .* has rope_theta=10000.0")]


@pytest.mark.parametrize("change, message", MISMATCHES, ids=[next(iter(c)) for c, _ in MISMATCHES])
def test_a_qwen3_moe_model_of_another_shape_is_refused_in_one_line(tmp_path, moe_preset, change, message):
    hf = hf_moe(tmp_path / "hf", **change)
    with pytest.raises(UserError, match=message) as refused:
        import_hf(hf, tmp_path / "run", preset=moe_preset)
    assert "\n" not in str(refused.value) and "pass the preset of its shape" in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_the_preset_of_its_shape_is_named(tmp_path, moe_preset):
    """With the default preset (a dense model's) the line names the preset whose model the directory is."""
    hf = hf_moe(tmp_path / "hf")
    with pytest.raises(UserError, match=r"num_experts=4, but the preset llmjp3-1.8b's model \(shape llmjp3-1.8b\) has "
                                        r"num_experts=0 \(\d+ more fields differ\): pass the preset of its shape, "
                                        "--preset test-moe"):
        import_hf(hf, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_unrenormalised_top_k_weights_are_refused(tmp_path, moe_preset):
    hf = hf_moe(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    with pytest.raises(UserError, match="norm_topk_prob=false .* llmjp-ds imports qwen3_moe models with "
                                        "norm_topk_prob=true only"):
        import_hf(hf, tmp_path / "run", preset=moe_preset)
