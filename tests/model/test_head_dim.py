"""A head width set apart from hidden / heads (``model.overrides.head_dim``): the layer shape of one GPU's share
of a tensor-parallel 172B stage (``llmjp-ds bench --shapes 172b-tp4-stage``), and the HF ``head_dim`` field."""

from __future__ import annotations

import torch
import transformers

from llmjp_ds.model import LlamaForCausalLM, model_config
from llmjp_ds.model.flops import flops_per_token_for, model_flops_per_token


def _config():
    # 4 heads of 16 on a hidden size of 128: heads * head_dim (64) != hidden
    return model_config("tiny", head_dim=16, num_layers=2)


def test_config_carries_head_dim():
    config = _config()
    assert config.head_dim == 16 and config.hidden_size == 128 and config.num_attention_heads == 4
    assert model_config("tiny").head_dim == 32  # unset: hidden / heads


def test_import_matches_hf_logits(tmp_path):
    config = _config()
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (64, 128)
    hf.save_pretrained(tmp_path / "hf")
    ours = LlamaForCausalLM.from_pretrained(tmp_path / "hf", backend="torch").eval()
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_flops_count_the_narrow_heads():
    config = _config()
    wide = model_flops_per_token(hidden_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=352, vocab_size=config.vocab_size, seq_len=256)
    narrow = flops_per_token_for(config, 256)
    # the attention projections and scores shrink with the head width, the MLP and logits do not
    assert narrow < wide
    assert narrow == model_flops_per_token(hidden_size=128, num_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=352,
                                           vocab_size=config.vocab_size, seq_len=256, head_dim=16)
