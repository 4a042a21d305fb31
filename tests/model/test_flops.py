"""Model FLOPs and parameter counts against a worked example (the 172B preset) and against torch's FLOP counter."""

from __future__ import annotations

import pytest

from llmjp_ds.model import model_config
from llmjp_ds.model.flops import flops_per_token_for, model_flops_per_token, parameter_count, parameter_count_for

# llmjp3-172b (LLMJP.md): hidden 12288, 96 layers, 96 heads of 128, 16 KV heads, ffn 38464, vocab 99840, seq 4096.
LLMJP3_172B = dict(hidden_size=12288, num_layers=96, num_attention_heads=96, num_key_value_heads=16,
                   intermediate_size=38464)


def test_172b_flops_per_token_worked_by_hand():
    # Forward FLOPs per token of one decoder layer; a GEMM with a (k x m) weight costs 2*k*m per token.
    q_proj = 2 * 12288 * 12288  # 12288 -> 96 heads x 128 = 12288
    assert q_proj == 301_989_888
    kv_proj = 2 * (2 * 12288 * 2048)  # K and V: 12288 -> 16 KV heads x 128 = 2048 (GQA)
    assert kv_proj == 100_663_296
    o_proj = 2 * 12288 * 12288
    assert o_proj == 301_989_888
    # QK^T and AV: each 2 x (96 x 128) x 4096 per token over the full matrix = 201,326,592 for both;
    # causal: half of it (Megatron-LM's newer convention).
    scores = (2 * 2 * 12288 * 4096) // 2
    assert scores == 100_663_296
    mlp = 3 * (2 * 12288 * 38464)  # SwiGLU: gate and up (12288 -> 38464), down (38464 -> 12288)
    assert mlp == 2_835_873_792
    layer = q_proj + kv_proj + o_proj + scores + mlp
    assert layer == 3_641_180_160

    logits = 2 * 12288 * 99840  # lm_head over the padded vocabulary
    assert logits == 2_453_667_840
    forward = 96 * layer + logits
    assert forward == 349_553_295_360 + 2_453_667_840 == 352_006_963_200
    training = 3 * forward  # backward = 2 x forward (input grads + weight grads)
    assert training == 1_056_020_889_600  # about 1.056 TFLOP per token, 7.47 EFLOP per 7.08M-token step

    got = model_flops_per_token(**LLMJP3_172B, vocab_size=99840, seq_len=4096)
    assert got == training

    # The same through the weights: 6 FLOPs per token per matmul weight, plus the attention scores.
    matmul_params = 96 * (12288 * 12288 * 2 + 2 * 12288 * 2048 + 3 * 12288 * 38464) + 99840 * 12288
    assert got == 6 * matmul_params + 3 * 96 * scores

    # Full (non-causal) attention adds the other half of the score term: +2.7% at s=4096.
    full = model_flops_per_token(**LLMJP3_172B, vocab_size=99840, seq_len=4096, causal=False)
    assert full - got == 3 * 96 * scores
    assert full / got == pytest.approx(1.02745, abs=1e-5)


def test_172b_parameter_count_matches_llmjp_figures():
    per_layer = (
        12288 * 12288  # q_proj     150,994,944
        + 2 * 12288 * 2048  # k, v  50,331,648
        + 12288 * 12288  # o_proj   150,994,944
        + 3 * 12288 * 38464  # gate, up, down 1,417,936,896
        + 2 * 12288  # two RMSNorm weights 24,576
    )
    assert per_layer == 1_770_283_008
    non_embedding = 96 * per_layer + 12288  # + final RMSNorm
    assert non_embedding == 169_947_181_056  # LLMJP.md

    # LLM-jp's embedding figure is input + output embedding at the 99,487 live tokenizer ids ...
    live = parameter_count(**LLMJP3_172B, vocab_size=99487)
    assert live == {"non_embedding": 169_947_181_056, "embedding": 2_444_992_512,
                    "total": 169_947_181_056 + 2_444_992_512, "active": 169_947_181_056 + 2_444_992_512}
    assert 2 * 99487 * 12288 == 2_444_992_512
    # ... while the checkpoint holds the vocabulary padded to 99,840.
    padded = parameter_count(**LLMJP3_172B, vocab_size=99840)
    assert padded["embedding"] == 2 * 99840 * 12288 == 2_453_667_840
    assert padded["non_embedding"] == non_embedding


def test_flops_per_token_for_reads_a_llama_config():
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=12288, num_hidden_layers=96, num_attention_heads=96, num_key_value_heads=16,
                          intermediate_size=38464, vocab_size=99840, max_position_embeddings=4096, head_dim=None)
    assert flops_per_token_for(cfg) == 1_056_020_889_600
    assert flops_per_token_for(cfg, seq_len=2048) < flops_per_token_for(cfg)
    cfg.num_key_value_heads = None  # plain MHA: K and V as wide as Q
    assert flops_per_token_for(cfg) == model_flops_per_token(
        **{**LLMJP3_172B, "num_key_value_heads": 96}, vocab_size=99840, seq_len=4096)


def test_the_172b_preset_gives_the_hand_figures():
    from llmjp_ds.model import model_config

    cfg = model_config("llmjp3-172b")
    assert flops_per_token_for(cfg) == 1_056_020_889_600
    assert parameter_count_for(cfg) == {"non_embedding": 169_947_181_056, "embedding": 2_453_667_840,
                                        "total": 172_400_848_896, "active": 172_400_848_896}


def test_parameter_count_matches_our_model():
    from llmjp_ds.model import LlamaForCausalLM, model_config

    cfg = model_config("tiny")  # GQA, TE layout (fused QKV, fc1 = [gate; up]) on the CPU twin
    assert parameter_count_for(cfg)["total"] == sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


def test_rejects_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        model_flops_per_token(hidden_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=3,
                              intermediate_size=128, vocab_size=100, seq_len=16)


def test_matches_torch_flop_counter_on_a_transformers_llama():
    """Count the GEMMs torch actually runs in HF's Llama, forward and forward + backward."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    # GQA (4 heads, 2 KV heads), odd-ish sizes; eager attention so QK^T and AV are plain (full, unmasked-cost)
    # matmuls that the counter sees, hence causal=False below.
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
        vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    batch, seq = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    ours = flops_per_token_for(cfg, seq_len=seq, causal=False)
    tokens = batch * seq

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=ids)
    forward = counter.get_total_flops()
    assert 3 * forward / tokens == pytest.approx(ours, rel=0.01)

    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.get_total_flops() / tokens == pytest.approx(ours, rel=0.01)

    # Parameters: what the model holds.
    assert parameter_count_for(cfg)["total"] == sum(p.numel() for p in model.parameters())

    # Sanity of the reference itself: the causal count is smaller by exactly the halved score term.
    d = cfg.hidden_size // cfg.num_attention_heads
    halved = 3 * cfg.num_hidden_layers * (2 * cfg.num_attention_heads * d * seq)
    assert ours - flops_per_token_for(cfg, seq_len=seq) == halved


@pytest.mark.parametrize("preset", ["llmjp3-1.8b", "llmjp3-13b", "llmjp3-172b"])
def test_layer_and_logits_parts_are_one_layer_and_the_head(preset):
    from llmjp_ds.model.flops import layer_and_logits_flops_for

    c = model_config(preset)
    layer, logits = layer_and_logits_flops_for(c, 4096)
    assert logits == 6 * c.hidden_size * c.vocab_size
    one, two = (flops_per_token_for(model_config(preset, num_layers=n), 4096) for n in (1, 2))
    assert layer == pytest.approx(two - one, rel=1e-12)  # what one more decoder layer adds
    assert c.num_hidden_layers * layer + logits == pytest.approx(flops_per_token_for(c, 4096), rel=1e-12)


@pytest.mark.parametrize("preset, layers, stages, per_stage", [
    # the 1.8B head costs 2.95 decoder layers: the last stage gets fewer layers (DeepSpeed's type: split: 4 + 4)
    ("llmjp3-1.8b", 8, 2, [5, 3]),
    ("llmjp3-1.8b", 24, 4, [7, 7, 6, 4]),
    # the 172B head is 0.67 of a layer: PP32 keeps 3 layers on every stage, as docs/172b-layout.md plans
    ("llmjp3-172b", 96, 32, [3] * 32),
])
def test_flops_partition_balances_the_head_against_decoder_layers(preset, layers, stages, per_stage):
    from llmjp_ds.model.pipeline_layers import flops_weights
    from llmjp_ds.parallel.stages import stage_bounds

    c = model_config(preset, num_layers=layers)
    weights = flops_weights(c, 4096)
    bounds = stage_bounds(weights, stages)
    assert bounds[0] == 0 and bounds[-1] == layers + 2 and len(bounds) == stages + 1
    decoder = [sum(1 for i in range(a, b) if 0 < i <= layers) for a, b in zip(bounds, bounds[1:])]
    assert decoder == per_stage
    busiest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    layer, head = weights[1], weights[-1]
    assert busiest <= -(-layers // stages) * layer + head  # never worse than layers split evenly, head on top


def test_the_32b_a3b_preset_gives_llm_jp_4s_published_counts():
    """llm-jp-4-32b-a3b's model card: 32,139,028,992 parameters in all, 3,827,476,992 activated (the embedding and
    head included, as model cards count them), 503,316,480 in the embedding (the input one alone); transformers'
    Qwen3MoeForCausalLM of the preset's config, built on the meta device, has the same total."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from llmjp_ds.model import model_config

    config = model_config("llmjp4-32b-a3b")
    counts = parameter_count_for(config)
    assert (counts["total"], counts["active"]) == (32_139_028_992, 3_827_476_992)
    assert counts["embedding"] == 2 * 503_316_480 == 2 * config.vocab_size * config.hidden_size
    with torch.device("meta"):
        assert sum(p.numel() for p in Qwen3MoeForCausalLM(config).parameters()) == 32_139_028_992
    # per token: attention as the dense count, the router and 8 of the 128 experts' SwiGLU MLPs per layer
    dense = model_flops_per_token(hidden_size=2560, num_layers=32, num_attention_heads=40, num_key_value_heads=4,
                                  head_dim=128, intermediate_size=8 * 960, vocab_size=196608, seq_len=4096)
    assert flops_per_token_for(config, 4096) == dense + 3 * 32 * 2 * 2560 * 128
