"""Model sizes as data: the LLM-jp-3 family and a tiny model for CPU tests and the demo."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from llmjp_ds.errors import fail


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    ffn_hidden_size: int
    vocab_size: int  # padded, as stored in the checkpoint
    seq_len: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


MODEL_PRESETS: dict[str, ModelPreset] = {
    # ~2.7M parameters, trains on 2 CPU cores in minutes; vocab fits the demo tokenizer (8000 -> 8064).
    "tiny": ModelPreset(128, 4, 4, 2, 352, 8064, seq_len=256),
    "llmjp3-1.8b": ModelPreset(2048, 24, 16, 16, 7168, 99584),
    "llmjp3-3.7b": ModelPreset(3072, 28, 24, 24, 8192, 99584),
    "llmjp3-13b": ModelPreset(5120, 40, 40, 40, 13824, 99584),
    "llmjp3-172b": ModelPreset(12288, 96, 96, 16, 38464, 99840),
}


def pad_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """Megatron-style padding of the embedding rows (LLM-jp: 99487 -> 99584 with 128, -> 99840 with 512)."""
    return -(-vocab_size // multiple) * multiple


def get_preset(name: str) -> ModelPreset:
    if name not in MODEL_PRESETS:
        import difflib

        close = difflib.get_close_matches(name, MODEL_PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        fail(f"unknown model preset {name!r}{hint}: choose one of {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


def model_config(preset: str | ModelPreset = "tiny", **overrides):
    """A transformers ``LlamaConfig`` for a preset; ``overrides`` replace preset fields (e.g. ``num_layers=2``)."""
    from transformers import LlamaConfig

    p = get_preset(preset) if isinstance(preset, str) else preset
    unknown = set(overrides) - set(asdict(p))
    if unknown:
        fail(f"unknown model field(s) {sorted(unknown)}: valid fields are {', '.join(asdict(p))}")
    p = replace(p, **overrides)
    if p.hidden_size % p.num_attention_heads or p.num_attention_heads % p.num_key_value_heads:
        fail(f"hidden_size {p.hidden_size}, heads {p.num_attention_heads} and kv heads {p.num_key_value_heads} "
             "must divide evenly (hidden % heads == 0, heads % kv_heads == 0)")
    return LlamaConfig(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.ffn_hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.hidden_size // p.num_attention_heads,
        max_position_embeddings=p.seq_len,
        rms_norm_eps=p.rms_norm_eps,
        rope_theta=p.rope_theta,
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
    )


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def check_supported(config) -> None:
    """The architecture this package implements: Llama with RoPE (default type), RMSNorm, SwiGLU, no biases."""
    problems = []
    if getattr(config, "model_type", "llama") != "llama":
        problems.append(f"model_type is {config.model_type!r}, not 'llama'")
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        problems.append(f"rope type {params.get('rope_type')!r} (only plain RoPE)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("biases in attention or MLP")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"activation {config.hidden_act!r} (only SwiGLU/silu)")
    if getattr(config, "tie_word_embeddings", False):
        problems.append("tied embeddings")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        problems.append("head_dim * heads != hidden_size")
    if problems:
        fail("unsupported Llama variant: " + "; ".join(problems) + " — llmjp-ds trains LLM-jp-style Llama models")
