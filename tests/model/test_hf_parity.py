"""Our model against transformers' own LlamaForCausalLM: import, export, logits, loss and generation."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM

from llmjp_ds.model import LlamaForCausalLM

ATOL = 1e-5


def make_hf_model(config, seed=0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norm weights too, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def batch(config, b=2, s=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (b, s), generator=g)


def test_import_matches_hf_logits_and_loss(parity_config, tmp_path):
    hf = make_hf_model(parity_config)
    hf.save_pretrained(tmp_path / "hf")
    ours = LlamaForCausalLM.from_pretrained(tmp_path / "hf", backend="torch").eval()
    assert ours.dtype == torch.float32
    ids = batch(parity_config)
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
        out = ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fp8_lm_head", [False, True])
def test_export_is_bit_identical_and_loads_with_auto_classes(parity_config, tmp_path, fp8_lm_head):
    """Also with the FP8-capable head (``precision.fp8_lm_head``): the same weights, no ``_extra_state``."""
    hf = make_hf_model(parity_config, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    ours = LlamaForCausalLM.from_pretrained(tmp_path / "hf", backend="torch", fp8_lm_head=fp8_lm_head).eval()
    assert ("lm_head._extra_state" in ours.state_dict()) is fp8_lm_head
    ours.save_pretrained(tmp_path / "export")

    config = (tmp_path / "export" / "config.json").read_text()
    assert '"model_type": "llama"' in config and "auto_map" not in config and '"LlamaForCausalLM"' in config
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back) is transformers.LlamaForCausalLM
    source = hf.state_dict()
    exported = back.state_dict()
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    ids = batch(parity_config, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids).logits, atol=ATOL, rtol=0)
    base = AutoModel.from_pretrained(tmp_path / "export")
    assert type(base) is transformers.LlamaModel


def test_greedy_and_sampled_generation_match_hf(parity_config, tmp_path):
    hf = make_hf_model(parity_config, seed=7)
    hf.save_pretrained(tmp_path / "hf")
    ours = LlamaForCausalLM.from_pretrained(tmp_path / "hf", backend="torch").eval()
    prompt = batch(parity_config, b=2, s=5, seed=11)
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, pad_token_id=0)
    ref = hf.generate(prompt, do_sample=False, **kwargs)
    got = ours.generate(prompt, do_sample=False, **kwargs)
    assert got.shape == (2, 25)
    assert torch.equal(got, ref)
    # without the KV cache the result must not change
    assert torch.equal(ours.generate(prompt, do_sample=False, use_cache=False, **kwargs), ref)

    torch.manual_seed(123)
    ref_sampled = hf.generate(prompt, do_sample=True, top_k=0, temperature=1.0, **kwargs)
    torch.manual_seed(123)
    got_sampled = ours.generate(prompt, do_sample=True, top_k=0, temperature=1.0, **kwargs)
    assert torch.equal(got_sampled, ref_sampled)


def test_left_padded_batch_generation_matches_hf(tmp_path):
    from tests.conftest import PARITY_SHAPES
    from llmjp_ds.model import model_config

    config = model_config("tiny", **PARITY_SHAPES["gqa"])
    hf = make_hf_model(config, seed=2)
    hf.save_pretrained(tmp_path / "hf")
    ours = LlamaForCausalLM.from_pretrained(tmp_path / "hf", backend="torch").eval()
    ids = batch(config, b=2, s=7, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # first row is left-padded
    ids[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), hf.generate(ids, **kwargs))


def test_z_loss_is_reported_apart_and_added(tmp_path):
    from llmjp_ds.model import model_config

    config = model_config("tiny", num_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                          ffn_hidden_size=64, vocab_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, backend="torch", z_loss_coeff=1e-4).eval()
    ids = batch(config, s=10)
    out = model(input_ids=ids, labels=ids)
    logits = out.logits[:, :-1].float()
    log_z = torch.logsumexp(logits, dim=-1)
    expected_z = 1e-4 * log_z.pow(2).mean()
    expected_lm = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.z_loss, expected_z)
    torch.testing.assert_close(out.lm_loss, expected_lm)
    torch.testing.assert_close(out.loss, expected_lm + expected_z)
