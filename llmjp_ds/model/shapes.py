"""Model shapes as data: the LLM-jp-3 and LLM-jp-4 families and a tiny model for CPU tests and the demo.

A run preset (:mod:`llmjp_ds.config.presets`) names one of these shapes in ``model.shape``; ``model.overrides``
(:class:`ShapeOverrides`) replaces single fields of it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import asdict, dataclass, replace

from llmjp_ds.errors import did_you_mean, fail


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    ffn_hidden_size: int
    vocab_size: int  # padded, as stored in the checkpoint
    seq_len: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    head_dim: int | None = None  # None: hidden / heads (every LLM-jp-3 size); else heads * head_dim may differ
    # queries and keys RMS-normalised per head before RoPE (Qwen3's q_norm / k_norm, Megatron's --qk-layernorm)
    qk_norm: bool = False
    # a mixture of experts (a Hugging Face qwen3_moe model): routed experts, each token's top k of them, and each
    # expert's SwiGLU width; every layer but the dense ones (transformers' mlp_only_layers) is MoE
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: int | None = None
    dense_layers: tuple[int, ...] = ()


MODEL_SHAPES: dict[str, ModelShape] = {
    # ~2.7M parameters; the vocabulary fits the demo tokenizer (8000 pieces, padded to 8064).
    "tiny": ModelShape(128, 4, 4, 2, 352, 8064, seq_len=256),
    "llmjp3-1.8b": ModelShape(2048, 24, 16, 16, 7168, 99584),
    "llmjp3-3.7b": ModelShape(3072, 28, 24, 24, 8192, 99584),
    "llmjp3-13b": ModelShape(5120, 40, 40, 40, 13824, 99584),
    "llmjp3-172b": ModelShape(12288, 96, 96, 16, 38464, 99840),
    # LLM-jp-4 (tokenizer v4: 196,608 pieces = 1536 x 128, a multiple of 128 x TP at TP1-8, so Megatron pads no
    # rows). The 8B is Llama-3-8B's shape: GQA with 8 KV groups, RoPE base 500000, RMSNorm eps 1e-6.
    "llmjp4-8b": ModelShape(4096, 32, 32, 8, 14336, 196608, rope_theta=500000.0, rms_norm_eps=1e-6),
    # Published: 64 layers, hidden 5120, FFN 27648 (TP4). The heads are not: 40 heads of 128 with 8 KV groups is an
    # assumption (Qwen2.5-32B's at this width, and Llama-3's GQA); RoPE, eps and vocabulary as the 8B's v4 recipe.
    "llmjp4-32b": ModelShape(5120, 64, 40, 8, 27648, 196608, rope_theta=500000.0, rms_norm_eps=1e-6),
    # llm-jp-4-32b-a3b (Hugging Face qwen3_moe): 32 layers, hidden 2560, 40 heads of 128 with 4 KV groups, qk-norm,
    # 128 experts of SwiGLU width 960, 8 a token, every layer MoE, untied head: 32,139,028,992 parameters,
    # 3,827,476,992 active (its model card; tests/model/test_moe_shapes.py). Pretraining sequences of 4096 as the
    # 8B (the release's 65,536 context came after); ffn_hidden_size is its config's intermediate_size, which an
    # all-MoE model never uses
    "llmjp4-32b-a3b": ModelShape(2560, 32, 40, 4, 7680, 196608, rope_theta=500000.0, rms_norm_eps=1e-6,
                                 head_dim=128, qk_norm=True, num_experts=128, experts_per_token=8,
                                 moe_ffn_hidden_size=960),
    # four of its layers with its whole 196,608-row head: what one H200 trains beside Megatron-Core's MoE
    "llmjp4-moe-slice": ModelShape(2560, 4, 40, 4, 7680, 196608, rope_theta=500000.0, rms_norm_eps=1e-6,
                                   head_dim=128, qk_norm=True, num_experts=128, experts_per_token=8,
                                   moe_ffn_hidden_size=960),
    # the parity check's MoE (benchmarks/parity, --moe): llmjp4-32b-a3b's design at a width one H200 trains four
    # times at once beside Megatron-LM (32 experts of width 256, 8 a token, qk-norm, 8 heads of 64 with 4 KV groups,
    # every layer MoE), on the LLM-jp v3 tokenizer's vocabulary, RoPE and eps as LLM-jp-3's
    "parity-moe": ModelShape(512, 8, 8, 4, 1536, 99584, head_dim=64, qk_norm=True, num_experts=32,
                             experts_per_token=8, moe_ffn_hidden_size=256),
    # the MoE model of CPU tests and `llmjp-ds demo --moe`: 8 experts, 2 a token, the demo tokenizer's vocabulary
    "tiny-moe": ModelShape(128, 4, 4, 2, 256, 8064, seq_len=256, head_dim=32, qk_norm=True, num_experts=8,
                           experts_per_token=2, moe_ffn_hidden_size=64),
}

# ``model.overrides``: every field of ModelShape, optional (None keeps the shape's value)
ShapeOverrides = dataclasses.make_dataclass(
    "ShapeOverrides",
    [(f.name, typing.get_type_hints(ModelShape)[f.name] | None, dataclasses.field(default=None))
     for f in dataclasses.fields(ModelShape)],
    namespace={"__doc__": "Fields of a ModelShape to replace; None keeps the shape's value.",
               "__module__": __name__,
               # the config loader (pydantic) refuses a field that is not one of these
               "__pydantic_config__": {"extra": "forbid"}})


def overrides_dict(overrides) -> dict:
    """The fields an overrides object (or a plain dict) sets, as a dict."""
    if isinstance(overrides, dict):
        return dict(overrides)
    return {k: v for k, v in asdict(overrides).items() if v is not None}


def pad_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """Megatron-style padding of the embedding rows (LLM-jp: 99487 -> 99584 with 128, -> 99840 with 512)."""
    return -(-vocab_size // multiple) * multiple


def get_shape(name: str) -> ModelShape:
    if name not in MODEL_SHAPES:
        fail(f"unknown model shape {name!r}{did_you_mean(name, MODEL_SHAPES)}: choose one of "
             f"{', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]


def resolve_shape(shape: str | ModelShape, overrides=None) -> ModelShape:
    """The shape with ``overrides`` (a :class:`ShapeOverrides` or a dict of fields) applied."""
    p = get_shape(shape) if isinstance(shape, str) else shape
    fields = overrides_dict(overrides or {})
    unknown = set(fields) - set(asdict(p))
    if unknown:
        fail(f"unknown model field(s) {sorted(unknown)}: valid fields are {', '.join(asdict(p))}")
    if "dense_layers" in fields:
        fields["dense_layers"] = tuple(fields["dense_layers"])
    return replace(p, **fields)


def model_config(shape: str | ModelShape = "tiny", **overrides):
    """The transformers config of a shape: ``LlamaConfig``, ``Qwen3Config`` (qk-norm) or ``Qwen3MoeConfig``
    (experts); ``overrides`` replace its fields (e.g. ``num_layers=2``)."""
    p = resolve_shape(shape, overrides)
    if (p.head_dim is None and p.hidden_size % p.num_attention_heads) or p.num_attention_heads % p.num_key_value_heads:
        fail(f"hidden_size {p.hidden_size}, heads {p.num_attention_heads} and kv heads {p.num_key_value_heads} "
             "must divide evenly (hidden % heads == 0 unless model.overrides sets head_dim, heads % kv_heads == 0)")
    check_experts(p)
    if p.num_experts:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**_common_fields(p), num_experts=p.num_experts, num_experts_per_tok=p.experts_per_token,
                              moe_intermediate_size=p.moe_ffn_hidden_size, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=list(p.dense_layers),
                              output_router_logits=False)
    if p.qk_norm:
        from transformers import Qwen3Config

        return Qwen3Config(**_common_fields(p))
    from transformers import LlamaConfig

    return LlamaConfig(**_common_fields(p), mlp_bias=False)


def check_experts(p: ModelShape) -> None:
    """An MoE shape's numbers agree with each other and with transformers' Qwen3-MoE (one line each)."""
    if not p.num_experts:
        if p.experts_per_token or p.moe_ffn_hidden_size or p.dense_layers:
            fail("experts_per_token, moe_ffn_hidden_size and dense_layers describe a mixture of experts, but "
                 "num_experts is 0: set model.overrides.num_experts, or remove them")
        return
    if not 1 <= p.experts_per_token <= p.num_experts:
        fail(f"experts_per_token={p.experts_per_token} must be between 1 and num_experts={p.num_experts} (each token "
             "goes to that many of the experts): lower it, or add experts")
    if not p.moe_ffn_hidden_size:
        fail("an MoE shape needs moe_ffn_hidden_size, each expert's SwiGLU width (--moe-ffn-hidden-size)")
    if not p.qk_norm:
        fail("an MoE shape is a Hugging Face qwen3_moe model, which normalises queries and keys: set qk_norm=true")
    bad = [i for i in p.dense_layers if not 0 <= i < p.num_layers]
    if bad:
        fail(f"dense_layers {list(p.dense_layers)} names layer {bad[0]}, but the model has layers "
             f"0..{p.num_layers - 1}")


def _common_fields(p: ModelShape) -> dict:
    return dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.ffn_hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim or p.hidden_size // p.num_attention_heads,
        max_position_embeddings=p.seq_len,
        rms_norm_eps=p.rms_norm_eps,
        rope_theta=p.rope_theta,
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
    )


def has_qk_norm(config) -> bool:
    """Whether queries and keys are RMS-normalised per head before RoPE (Qwen3's ``q_norm`` / ``k_norm``,
    Megatron-LM's ``--qk-layernorm``): the ``qwen3`` and ``qwen3_moe`` configs."""
    return getattr(config, "model_type", "llama") in ("qwen3", "qwen3_moe")


def is_moe_layer(config, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` is a mixture of experts (transformers' Qwen3-MoE rule: experts, not in
    ``mlp_only_layers``, and every ``decoder_sparse_step``-th layer)."""
    experts = getattr(config, "num_experts", 0) or 0
    return experts > 0 and layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and \
        (layer_idx + 1) % (getattr(config, "decoder_sparse_step", 1) or 1) == 0


def moe_layers(config) -> list[int]:
    """The indices of the decoder layers that are mixtures of experts (:func:`is_moe_layer`), in order."""
    return [i for i in range(config.num_hidden_layers) if is_moe_layer(config, i)]


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")  # Hugging Face model types this package builds


def check_supported(config) -> None:
    """The architecture this package implements: Llama with RoPE (default type), RMSNorm, SwiGLU, no biases; with
    qk-norm (qwen3) and a mixture of experts (qwen3_moe)."""
    problems = []
    if getattr(config, "model_type", "llama") not in MODEL_TYPES:
        problems.append(f"model_type is {config.model_type!r}, not one of {', '.join(MODEL_TYPES)}")
    if getattr(config, "use_sliding_window", False):
        problems.append("sliding-window attention")
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        problems.append(f"rope type {params.get('rope_type')!r} (only plain RoPE)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("biases in attention or MLP")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"activation {config.hidden_act!r} (only SwiGLU/silu)")
    if getattr(config, "tie_word_embeddings", False):
        problems.append("tied embeddings")
    if problems:
        fail("unsupported Llama variant: " + "; ".join(problems) + " — llmjp-ds trains LLM-jp-style Llama models")
